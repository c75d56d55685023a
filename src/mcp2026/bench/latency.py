"""Single-stream latency: greedy decode tok/s (128 new tokens, EOS ignored) and 512-token prefill
tok/s of one model, ours vs HF transformers (and llama.cpp when installed) on the same weights and token ids,
in one process. Engines alternate within every repeat (ours, HF, ours, HF, ...); warm-up rounds are excluded;
the reported figure is the median over repeats.

Counted: decode tok/s = (N - 1) / (time of token N - time of token 1), i.e. decode steps only; prefill tok/s
= prompt tokens / (time from submitting the prompt to its first generated token).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from mcp2026 import hardware
from mcp2026.bench import peers
from mcp2026.bench.bitplan import model_layer_bits
from mcp2026.bench.peers import (
    GenerationTiming,
    hf_decode_latency,
    hf_prefill,
    llama_cpp_decode_latency,
    llama_cpp_prefill,
)
from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.weights import check_weights, quant_config
from mcp2026.bench.workloads import WorkloadSpec, load_workload
from mcp2026.config import KVConfig, SchedulerConfig
from mcp2026.pipeline import Pipeline, resolve_dtype
from mcp2026.types import SamplingParams

DECODE_PROMPT = "Write a short story about a robot who learns to paint, in about two hundred words."
ENGINE_LABELS = {"mcp2026": "mcp2026", "hf": "HF transformers", "llama.cpp": "llama.cpp"}


@dataclass(frozen=True)
class LatencyConfig:
    model: str | None = None  # None: the embedded default model
    # auto: what Pipeline() runs by default (a GGUF's stored formats as they are); fp32 / bf16: float weights
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    new_tokens: int = 128
    prefill_tokens: int = 512
    repeats: int = 5
    warmup: int = 1
    peer: bool = True
    seed: int = 0  # random token ids of the prefill prompt
    # extra rows of ours with quantized weights: int8 | int4 | fp8 (uniform), or dqg:BITS (a DQG plan at that
    # average bits per weight, calibrated on ShareGPT at load)
    weights: tuple[str, ...] = ()
    # ours drafts by prompt lookup as Pipeline() does by default; False: plain decoding, one token a step
    speculative: bool = True
    # 0: decode after the short chat prompt; N: after N tokens of held-out ShareGPT conversations (random ids
    # without a tokenizer), where attention over the context weighs in every step
    context_tokens: int = 0

    def __post_init__(self) -> None:
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (decode rate needs two tokens), got {self.new_tokens}")
        if self.prefill_tokens < 1 or self.repeats < 1 or self.warmup < 0 or self.context_tokens < 0:
            raise ValueError("prefill_tokens and repeats must be >= 1, warmup and context_tokens >= 0")
        bad = [d for d in self.dtypes if d not in ("auto", "fp32", "bf16")]
        if bad or not self.dtypes:
            raise ValueError(f"dtypes must be a non-empty list of auto, fp32, bf16; got {list(self.dtypes)}")
        check_weights(self.weights, ("int8", "int4", "fp8"))

    def command(self) -> str:
        parts = ["mcp2026 bench latency"]
        if self.model:
            parts.append(f"--model {self.model}")
        parts += [
            f"--dtype {','.join(self.dtypes)}",
            f"--new-tokens {self.new_tokens}",
            f"--prefill-tokens {self.prefill_tokens}",
            f"--repeats {self.repeats}",
            f"--warmup {self.warmup}",
            f"--seed {self.seed}",
        ]
        if self.weights:
            parts.append(f"--weights {','.join(self.weights)}")
        if not self.peer:
            parts.append("--no-peer")
        if not self.speculative:
            parts.append("--no-speculative")
        if self.context_tokens:
            parts.append(f"--context-tokens {self.context_tokens}")
        return " ".join(parts)

    @property
    def kind(self) -> str:
        """The run's kind: a long-context run is not the headline's chat-prompt latency."""
        return "latency-context" if self.context_tokens else "latency"


@dataclass
class Contender:
    """One engine at one precision, with its two measurements (each returns a GenerationTiming)."""

    engine: str
    dtype: str
    decode: Any
    prefill: Any


def _ours(pipe: Any, dtype: str) -> Contender:
    engine = pipe.engine

    def run(prompt_ids: list[int], new_tokens: int) -> GenerationTiming:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        request_id = engine.add_request(prompt_ids, params)
        times: list[float] = []
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == request_id and out.delta_token_ids:
                    times.append(time.perf_counter())
                final = out if out.finished else final
        return GenerationTiming(start, time.perf_counter(), times, [list(final.output.token_ids)])

    return Contender("mcp2026", dtype, lambda ids, n: run(ids, n), lambda ids: run(ids, 1))


def _hf(hf: Any, dtype: str) -> Contender:
    return Contender(
        "hf", dtype, lambda ids, n: hf_decode_latency(hf, ids, n), lambda ids: hf_prefill(hf, ids)
    )


def _llama_cpp(llm: Any) -> Contender:
    return Contender(
        "llama.cpp",
        "gguf",
        lambda ids, n: llama_cpp_decode_latency(llm, ids, n),
        lambda ids: llama_cpp_prefill(llm, ids),
    )


def _speculative(config: LatencyConfig) -> str | None:
    return None if config.speculative else "off"  # None: Pipeline's default


def _prompts(pipe: Any, config: LatencyConfig) -> tuple[list[int], list[int]]:
    tokenizer = pipe.tokenizer
    vocab = pipe.loaded.config.vocab_size
    n = config.context_tokens
    if n and tokenizer is not None:
        spec = WorkloadSpec("long", 1, config.seed, min_context_len=n, max_context_len=n)
        decode_ids = load_workload(spec, tokenizer, vocab)[0].prompt_token_ids
    elif n:
        decode_ids = load_workload(WorkloadSpec("random", 1, config.seed + 1, input_len=n), None, vocab)[0]
        decode_ids = decode_ids.prompt_token_ids
    elif tokenizer is not None and getattr(tokenizer, "chat_template", None):
        decode_ids = tokenizer.encode_chat([{"role": "user", "content": DECODE_PROMPT}])
    elif tokenizer is not None:
        decode_ids = tokenizer.encode(DECODE_PROMPT)
    else:
        decode_ids = load_workload(WorkloadSpec("random", 1, config.seed + 1, input_len=16), None, vocab)[0]
        decode_ids = decode_ids.prompt_token_ids
    spec = WorkloadSpec("random", 1, config.seed, input_len=config.prefill_tokens, output_len=1)
    prefill_ids = load_workload(spec, None, vocab)[0].prompt_token_ids
    return decode_ids, prefill_ids


def _load_contenders(
    config: LatencyConfig, notes: list[str], layer_bits: dict[str, dict[str, float]]
) -> tuple[list[Contender], Any, dict[str, float]]:
    """Every engine of the run, loaded; fills ``layer_bits`` (each quantized config's bits per linear)."""

    load_s: dict[str, float] = {}
    # Sequences as long as the workload's (the chat prompt is a few dozen tokens): a model's full context could
    # outgrow the 0.5 GB pool (Gemma 3: 32k positions x 36 KiB)
    longest = max(config.prefill_tokens, config.context_tokens, 256)
    scheduler = SchedulerConfig(max_model_len=longest + config.new_tokens)
    contenders, pipes = [], {}
    for dtype in config.dtypes:
        t0 = time.perf_counter()
        # Prefix caching off: the same prompt is measured again and again.
        kv = KVConfig(memory_gb=0.5, enable_prefix_caching=False)
        pipes[dtype] = Pipeline(
            config.model, dtype=dtype, kv_config=kv, scheduler=scheduler, speculative=_speculative(config)
        )
        load_s[f"mcp2026-{dtype}"] = time.perf_counter() - t0
    quantized = []
    for fmt in config.weights:  # activations in the first dtype; the format's kernel picks its compute dtype
        t0 = time.perf_counter()
        kv = KVConfig(memory_gb=0.5, enable_prefix_caching=False)
        pipe = Pipeline(
            config.model,
            quant_config(fmt),
            config.dtypes[0],
            kv_config=kv,
            scheduler=scheduler,
            speculative=_speculative(config),
        )
        quantized.append(_ours(pipe, f"{fmt} weights"))
        layer_bits[f"{fmt} weights"] = model_layer_bits(pipe.loaded.model)
        load_s[f"mcp2026-{fmt}"] = time.perf_counter() - t0
    hf_models: dict[str, Any] = {}
    if config.peer:
        t0 = time.perf_counter()
        try:
            first = peers.load_hf_peer(config.model, resolve_dtype(config.dtypes[0], None))
        except peers.PeerUnavailable as e:
            notes.append(str(e))
        else:
            hf_models[config.dtypes[0]] = first
            for dtype in config.dtypes[1:]:
                hf_models[dtype] = peers.hf_with_dtype(first, resolve_dtype(dtype, None))
            load_s["hf"] = time.perf_counter() - t0
    for dtype in config.dtypes:
        label = dtype if dtype != "auto" else f"auto: {pipes[dtype].loaded.weights} weights"
        contenders.append(_ours(pipes[dtype], label))
        if dtype in hf_models:
            contenders.append(_hf(hf_models[dtype], dtype))
    contenders += quantized
    if config.peer:
        try:
            n_ctx = max(2048, longest + config.new_tokens)  # its context holds the longest prompt's
            contenders.append(_llama_cpp(peers.load_llama_cpp(config.model, n_ctx=n_ctx)))
        except peers.PeerUnavailable as e:
            notes.append(str(e))
    else:
        notes.append("peers skipped (--no-peer)")
    if "bf16" in config.dtypes and not hardware.has_fast_bf16():
        notes.append(
            "bf16 rows: this CPU has no AVX512-BF16/AMX, so bf16 matmuls are emulated and several times slower "
            "than fp32; they are reported for completeness, not as representative figures"
        )
    return contenders, pipes[config.dtypes[0]], load_s


def run_latency(config: LatencyConfig | None = None, progress: Any = None) -> BenchRun:
    config = config or LatencyConfig()
    notes: list[str] = [
        "mcp2026 drafts by prompt lookup, as by default (exact: greedy tokens as plain decoding's); a step that "
        "kept drafts gives several tokens (the tokens-per-step column); `--no-speculative` decodes one a step"
        if config.speculative
        else "mcp2026 decodes one token a step (--no-speculative)"
    ]
    layer_bits: dict[str, dict[str, float]] = {}
    contenders, pipe, load_s = _load_contenders(config, notes, layer_bits)
    decode_ids, prefill_ids = _prompts(pipe, config)
    records: list[dict[str, Any]] = []
    rounds = config.warmup + config.repeats
    task = progress.add_task("latency", total=rounds * len(contenders)) if progress is not None else None
    for r in range(rounds):
        for c in contenders:  # interleaved: every engine once per round
            d = c.decode(decode_ids, config.new_tokens)
            p = c.prefill(prefill_ids)
            base = {"engine": c.engine, "dtype": c.dtype, "round": r, "warmup": r < config.warmup}
            records.append(
                {
                    **base,
                    "metric": "decode",
                    "tokens": d.decode_tokens,
                    "steps": d.num_steps - 1,
                    "seconds": d.decode_seconds,
                    "tok_per_s": d.decode_tokens / d.decode_seconds if d.decode_seconds > 0 else float("nan"),
                    "ttft_s": d.token_times[0] - d.start,
                    "token_ids": d.token_ids[0],
                }
            )
            records.append(
                {
                    **base,
                    "metric": "prefill",
                    "tokens": len(prefill_ids),
                    "seconds": p.seconds,
                    "tok_per_s": len(prefill_ids) / p.seconds,
                }
            )
            if progress is not None:
                progress.advance(task)
    aggregates = _aggregate(records, contenders)
    aggregates["load_seconds"] = load_s
    aggregates["decode_prompt_len"] = len(decode_ids)
    aggregates["greedy_agreement"] = _agreement(records)
    aggregates["layer_bits"] = layer_bits  # the bit-plan heatmaps of `bench report`
    run = BenchRun(
        kind=config.kind,
        command=config.command(),
        config={**asdict(config), "decode_prompt": DECODE_PROMPT},
        records=records,
        aggregates=aggregates,
        notes=notes,
        machine=machine_info(),
    )
    run.tables = [_table(aggregates, config, len(decode_ids))]
    return run


def _aggregate(records: list[dict[str, Any]], contenders: list[Contender]) -> dict[str, Any]:
    medians: dict[str, dict[str, float]] = {}
    for c in contenders:
        key = f"{c.engine}/{c.dtype}"
        medians[key] = {}
        for metric in ("decode", "prefill"):
            values = [
                x["tok_per_s"]
                for x in records
                if x["engine"] == c.engine
                and x["dtype"] == c.dtype
                and x["metric"] == metric
                and not x["warmup"]
            ]
            medians[key][metric] = statistics.median(values) if values else float("nan")
        # drafted tokens kept (speculative decoding, on by default for ours) make a step yield several
        decodes = [x for x in records if x["engine"] == c.engine and x["dtype"] == c.dtype]
        decodes = [x for x in decodes if x["metric"] == "decode" and not x["warmup"] and x["steps"]]
        medians[key]["tokens_per_step"] = (
            sum(x["tokens"] for x in decodes) / sum(x["steps"] for x in decodes) if decodes else float("nan")
        )
    ratios: dict[str, dict[str, float]] = {}
    for key, ours in medians.items():
        if not key.startswith("mcp2026/"):
            continue
        dtype = key.split("/", 1)[1]
        for peer_key in (f"hf/{dtype}", "hf/fp32", "llama.cpp/gguf"):
            if peer_key in medians:
                ratios[f"{key} vs {peer_key}"] = {
                    m: ours[m] / medians[peer_key][m] if medians[peer_key][m] else float("nan")
                    for m in ("decode", "prefill")
                }
    return {"median_tok_per_s": medians, "ratios": ratios}


def _agreement(records: list[dict[str, Any]]) -> dict[str, int]:
    """Greedy decode tokens of mcp2026 vs HF at the same dtype: length of the common prefix (a sanity check
    that both ran the same computation; bf16 may legitimately diverge)."""
    result = {}
    last: dict[tuple[str, str], list[int]] = {}
    for x in records:
        if x["metric"] == "decode":
            last[(x["engine"], x["dtype"])] = x["token_ids"]
    for (engine, dtype), ids in last.items():
        if engine == "mcp2026" and ("hf", dtype) in last:
            ref = last[("hf", dtype)]
            n = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
            result[dtype] = n
    return result


def _table(aggregates: dict[str, Any], config: LatencyConfig, decode_prompt_len: int) -> Table:
    """Ratios against HF fp32, the baseline the speed targets are stated against (all pairs are in aggregates)."""
    medians = aggregates["median_tok_per_s"]
    ref = medians.get("hf/fp32")
    rows = []
    for key, m in medians.items():
        engine, dtype = key.split("/", 1)
        is_ref = key == "hf/fp32" or ref is None
        rows.append(
            [
                ENGINE_LABELS.get(engine, engine),
                dtype,
                m["decode"],
                f"{m['tokens_per_step']:.2f}",
                m["prefill"],
                "—" if is_ref else f"{m['decode'] / ref['decode']:.2f}x",
                "—" if is_ref else f"{m['prefill'] / ref['prefill']:.2f}x",
            ]
        )
    prompt = "ShareGPT context" if config.context_tokens else "chat prompt"
    title = (
        f"Single stream: decode {config.new_tokens} tokens after a {decode_prompt_len}-token {prompt}, "
        f"prefill {config.prefill_tokens} tokens (median of {config.repeats})"
    )
    columns = [
        "engine",
        "dtype",
        "decode tok/s",
        "tokens per decode step",
        "prefill tok/s",
        "decode vs HF fp32",
        "prefill vs HF fp32",
    ]
    return Table(title, columns, rows)
