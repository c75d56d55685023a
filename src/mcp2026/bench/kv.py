"""``mcp2026 bench kv``: what KV compression costs in quality and buys in memory and speed.

Quality: each sequence (held-out ShareGPT conversations, concatenated) is teacher-forced through the engine's
real paged path (``LLMEngine.score``) for the uncompressed reference and every config in lockstep: the first half
as a prompt in 256-token prefill chunks (as the scheduler would), the second half in ``chunk_size``-token
chunks with the evictor running between chunks. Every position is scored; ΔPPL = ppl / ppl_ref - 1, KLD =
mean KL(ref || config). Codec rows store K/V with that codec and evict nothing; eviction rows store K/V as
the model's dtype, so they measure eviction alone.

Also: the retrieval check (``kv_retrieval``), KV bytes per token and how many ``concurrent_len``-token
sequences a memory budget holds (from the codecs' block sizes), and decode tok/s at a long context,
uncompressed vs 70% eviction. Every engine's pool is sized explicitly to hold its whole sequence: the
scheduler admits a prompt only if the whole pool could hold it, whatever an eviction policy would drop.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mcp2026.bench import kv_retrieval as kr
from mcp2026.bench.kv_config import (
    DECODE_SPARSITY,
    PROMPT_CHUNK,
    KVBenchConfig,
    codec_of,
    config_name,
    parse_config,
)
from mcp2026.bench.kv_measure import (
    bounds_peak,
    context_speeds,
    kv_bytes_per_token,
    lockstep_group_size,
    max_concurrent_sequences,
    measurement_engine,
)
from mcp2026.bench.kv_peer import kv_type_bytes_ratio, llama_cpp_kv_quality
from mcp2026.bench.kv_report import notes, tables, targets
from mcp2026.bench.kv_retrieval import ANSWER_TOKENS
from mcp2026.bench.peers import PeerUnavailable
from mcp2026.bench.quality import compare_quality_many
from mcp2026.bench.report import BenchRun, machine_info
from mcp2026.bench.weights import quant_config
from mcp2026.bench.workloads import WorkloadSpec, load_workload
from mcp2026.config import DEFAULT_BLOCK_SIZE
from mcp2026.kv.codecs import make_codec
from mcp2026.kv.manager import cdiv
from mcp2026.kv.sizing import kv_block_bytes
from mcp2026.loading.loader import load_model
from mcp2026.pipeline import DTYPES
from mcp2026.quant.recipe import quantize_loaded


# ---- pieces -------------------------------------------------------------------------------------------
def token_sequences(
    text: str, tokenizer: Any | None, vocab_size: int, num: int, length: int, seed: int
) -> list[list[int]]:
    """``num`` sequences of ``length`` tokens: held-out ShareGPT conversations (the ``long`` workload's
    stream), or uniform random ids for ``text="random"`` and models without a tokenizer."""
    if text == "sharegpt" and tokenizer is not None:
        spec = WorkloadSpec("long", num, seed, output_len=1, min_context_len=length, max_context_len=length)
        return [r.prompt_token_ids for r in load_workload(spec, tokenizer, vocab_size)]
    spec = WorkloadSpec("random", num, seed, input_len=length, output_len=1)
    return [r.prompt_token_ids for r in load_workload(spec, None, vocab_size)]


def unavailable_codecs(codecs: Sequence[str], block_size: int | None = None) -> dict[str, str]:
    """Codecs whose encode/decode does not run on this device (e.g. no float8 conversion): name -> why."""
    missing = {}
    for name in codecs:
        codec = make_codec(name)
        x = torch.randn(1, block_size or codec.default_block_size, 64)
        try:
            for part in (codec.key, codec.value):
                part.decode(part.encode(x), torch.float32)
        except (RuntimeError, TypeError, NotImplementedError) as e:
            missing[name] = f"{type(e).__name__}: {e}".splitlines()[0]
    return missing


@dataclass(frozen=True)
class Speed:
    """Probed on the reference engine: seconds per prefill token, per chunk, per decode step."""

    per_token: float
    per_chunk: float
    per_step: float


def _probe(engine: Any, prompt: int, chunk: int) -> Speed:
    def chunk_times(num_tokens: int, chunk_size: int) -> list[float]:
        ids = torch.randint(engine.model_config.vocab_size, (num_tokens,)).tolist()
        times, t0 = [], time.perf_counter()
        for _ in engine.score(ids, prompt, prompt, chunk_size, "kv-probe"):
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        return times

    step = chunk_times(prompt + 2, 1)[-1]  # the first prompt chunk also warms up
    times = chunk_times(prompt + chunk, chunk)
    return Speed(times[0] / prompt, times[1], step)


def estimate_seconds(
    config: KVBenchConfig, num_tests: int, num_groups: int, speed: Speed
) -> dict[str, float]:
    """Forward passes x probed speed. Attention growth with context and eviction scoring are not included,
    so the real run takes longer."""
    n, p = config.context_tokens, config.prompt_len
    one_pass = p * speed.per_token + cdiv(n - p, config.chunk_size) * speed.per_chunk
    retrieval = (
        config.retrieval_seeds
        * (1 + len(config.retrieval_configs))
        * (config.retrieval_tokens * speed.per_token + ANSWER_TOKENS * speed.per_step)
    )
    engines = 2 + len(set(config.decode_configs) - {config_name(config.decode_policy, DECODE_SPARSITY)})
    decode = engines * (config.decode_context * speed.per_token + config.decode_tokens * speed.per_step)
    return {
        "quality": config.num_sequences * (num_tests + num_groups) * one_pass,
        "retrieval": retrieval if config.retrieval_configs else 0.0,
        "decode": decode if config.decode_context else 0.0,
    }


def _pooled(results: Sequence[Any]) -> dict[str, float]:
    """Token-weighted over sequences: perplexities from summed NLL, KLD and top-1 from summed counts."""

    def mean_nll(ppl: str, count: str) -> float:  # token-weighted mean NLL of a perplexity field
        total = sum(getattr(r, count) for r in results)
        return sum(math.log(getattr(r, ppl)) * getattr(r, count) for r in results) / total

    n = sum(r.num_tokens for r in results)
    nll_ref, nll = mean_nll("reference_ppl", "num_tokens"), mean_nll("ppl", "num_tokens")
    n_after = sum(r.num_tokens_after_prompt for r in results)
    after = float("nan")
    if n_after:
        delta = mean_nll("ppl_after_prompt", "num_tokens_after_prompt")
        after = math.exp(delta - mean_nll("reference_ppl_after_prompt", "num_tokens_after_prompt")) - 1.0
    return {
        "delta_ppl_after_prompt": after,
        "num_tokens_after_prompt": n_after,
        "num_tokens": n,
        "ppl_ref": math.exp(nll_ref),
        "ppl": math.exp(nll),
        "delta_ppl": math.exp(nll - nll_ref) - 1.0,
        "kld": sum(r.kld * r.num_tokens for r in results) / n,
        "top1_agreement": sum(r.top1_agreement * r.num_tokens for r in results) / n,
    }


# ---- the phases ---------------------------------------------------------------------------------------
@dataclass
class _Context:
    config: KVBenchConfig
    loaded: Any
    bf16_bytes: float  # KV bytes per token stored as bf16: the baseline of every ratio
    progress: Any
    skipped: dict[str, str]  # codecs that do not run on this device: name -> why
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def _group_size(ctx: _Context, num_tests: int) -> int:
    """Test engines per lockstep pass, so that pools and one chunk of logits each fit a share of memory."""
    block_size = ctx.config.block_size or DEFAULT_BLOCK_SIZE  # blocks of the model's dtype: the largest pool
    return lockstep_group_size(ctx.loaded, block_size, ctx.config.context_tokens, PROMPT_CHUNK, num_tests)


def _quality(
    ctx: _Context, ref: Any, grid: list[tuple[str, Any]], sequences: list[list[int]], group: int
) -> dict:
    config, model = ctx.config, ctx.loaded.config
    dtype = next(ctx.loaded.model.parameters()).dtype
    task = (
        ctx.progress.add_task("quality", total=cdiv(len(grid), group) * len(sequences))
        if ctx.progress is not None
        else None
    )
    results: dict[str, list[Any]] = {name: [] for name, _ in grid}
    kept: dict[str, list[float]] = {name: [] for name, _ in grid}
    for g in range(0, len(grid), group):
        part = grid[g : g + group]
        engines = [
            measurement_engine(ctx.loaded, kv, config.context_tokens, config.block_size) for _, kv in part
        ]
        for i, tokens in enumerate(sequences):
            before = [e.evictor.counters.num_evicted_blocks if e.evictor else 0 for e in engines]
            quality = compare_quality_many(
                ref, engines, tokens, config.prompt_len, PROMPT_CHUNK, config.chunk_size
            )
            for (name, kv), engine, q, b in zip(part, engines, quality, before):
                evicted = (engine.evictor.counters.num_evicted_blocks if engine.evictor else 0) - b
                block_bytes = kv_block_bytes(model, kv.block_size, dtype, kv.make_codec())
                num_blocks = cdiv(len(tokens), kv.block_size)
                kept[name].append((num_blocks - evicted) * block_bytes / len(tokens))
                results[name].append(q)
                ctx.records.append(
                    {"kind": "quality", "config": name, "sequence": i, **asdict(q), "evicted_blocks": evicted}
                )
            if ctx.progress is not None:
                ctx.progress.advance(task)
        del engines
    rows = {}
    for name, _ in grid:
        row = _pooled(results[name])
        row["kv_bytes_per_token"] = sum(kept[name]) / len(kept[name])
        row["bytes_ratio"] = ctx.bf16_bytes / row["kv_bytes_per_token"]
        rows[name] = row
    return {"rows": rows, "group_size": group}


def _llama_cpp_kv(ctx: _Context, sequences: list[list[int]]) -> dict[str, dict[str, float]] | None:
    """llama.cpp's KV types on the same sequences (bench.kv_peer), pooled as our rows; None (with a note)
    where llama-cpp-python or a GGUF file is missing."""
    config = ctx.config
    try:
        results = llama_cpp_kv_quality(config.model, sequences, config.prompt_len, config.llama_cpp_kv)
    except PeerUnavailable as e:
        ctx.notes.append(str(e))
        return None
    return {t: {**_pooled(r), "bytes_ratio": kv_type_bytes_ratio(t)} for t, r in results.items()}


def _retrieval(ctx: _Context) -> dict[str, Any]:
    config, loaded = ctx.config, ctx.loaded
    vocab = loaded.config.vocab_size
    # Text mode needs a tokenizer and real text; otherwise prompts are token ids.
    tokenizer = loaded.tokenizer if config.text == "sharegpt" else None
    overhead = kr.text_overhead(tokenizer) if tokenizer is not None else 2 * kr.KEY_LEN + kr.VALUE_LEN
    filler_len = config.retrieval_tokens - overhead
    if filler_len < 32:
        raise ValueError(
            f"--retrieval-tokens {config.retrieval_tokens} leaves no room for filler text; raise it"
        )
    fillers = token_sequences(
        config.text, tokenizer, vocab, config.retrieval_seeds, filler_len, config.seed + 1
    )
    prompts = [kr.build_prompt(config.seed * 10_000 + s, f, tokenizer, vocab) for s, f in enumerate(fillers)]
    longest = max(len(p.prompt_token_ids) for p in prompts) + kr.ANSWER_TOKENS
    configs = [("uncompressed", None)] + [
        (n, parse_config(n, config.identity, config.block_size))
        for n in config.retrieval_configs
        if codec_of(n, config.identity) not in ctx.skipped
    ]
    task = ctx.progress.add_task("retrieval", total=len(configs)) if ctx.progress is not None else None
    answers: dict[str, list[list[int]]] = {}
    for name, kv in configs:
        engine = measurement_engine(loaded, kv, longest, config.block_size)
        if longest > engine.max_model_len:
            raise ValueError(
                f"retrieval prompts need {longest} tokens, more than this model's {engine.max_model_len}; "
                "lower --retrieval-tokens"
            )
        answers[name] = kr.answers(engine, prompts)
        if ctx.progress is not None:
            ctx.progress.advance(task)
    scores = {}
    for name, _ in configs:
        s = kr.score(prompts, answers["uncompressed"], answers[name], tokenizer)
        scores[name] = {**asdict(s), "agreement": s.agreement, "accuracy": s.accuracy}
        for p, ref, got in zip(prompts, answers["uncompressed"], answers[name]):
            ctx.records.append(
                {
                    "kind": "retrieval",
                    "config": name,
                    "seed": p.seed,
                    "prompt_len": len(p.prompt_token_ids),
                    "answer_ids": got,
                    "answer_text": tokenizer.decode(got) if tokenizer is not None else None,
                    "answer": p.answer(got, tokenizer),
                    "agrees": p.answer(ref, tokenizer) == p.answer(got, tokenizer),
                    "identical": list(ref) == list(got),
                    "correct": p.is_correct(got, tokenizer),
                }
            )
    mean_len = sum(len(p.prompt_token_ids) for p in prompts) / len(prompts)
    return {
        "scores": scores,
        "mean_prompt_len": mean_len,
        "mode": "token ids" if tokenizer is None else "text",
    }


def _memory(ctx: _Context) -> dict[str, dict[str, float]]:
    """KV bytes per token and sequences of ``concurrent_len`` tokens a ``budget_gb`` pool holds."""
    config, model = ctx.config, ctx.loaded.config
    dtype = next(ctx.loaded.model.parameters()).dtype
    codecs = [c for c in config.codecs if c not in ctx.skipped]
    names = list(dict.fromkeys(["bf16", config.identity, *codecs]))
    # snap drops prompt blocks only, once; heavy_hitter holds a prompt whole until its end (the peak of a
    # 2048-token prompt is all of it)
    evicting = [p for p in config.policies if bounds_peak(p)]
    names += [f"bf16 + {config_name(evicting[0], s)}" for s in config.sparsities] if evicting else []
    names += [  # combined rows whose peak is their budget
        n.replace("+", " + ")
        for n in config.combined
        if codec_of(n, config.identity) not in ctx.skipped
        and bounds_peak(parse_config(n, config.identity, config.block_size).policy)
    ]
    budget = int(config.budget_gb * 1e9)
    rows = {}
    for name in names:
        kv = parse_config(name, config.identity, config.block_size)
        seqs = max_concurrent_sequences(model, kv, budget, config.concurrent_len, dtype)
        rows[name] = {"kv_bytes_per_token": kv_bytes_per_token(model, kv, dtype), "max_sequences": seqs}
    base = rows["bf16"]["max_sequences"]
    for row in rows.values():
        row["bytes_ratio"] = ctx.bf16_bytes / row["kv_bytes_per_token"]
        row["seqs_ratio"] = row["max_sequences"] / base if base else float("nan")
    return rows


def _decode(ctx: _Context) -> dict[str, Any]:
    config = ctx.config
    evict = config_name(config.decode_policy, DECODE_SPARSITY)
    names = dict.fromkeys((evict, *config.decode_configs))
    configs = [
        ("uncompressed", None),
        *((n, parse_config(n, config.identity, config.block_size)) for n in names),
    ]
    task = ctx.progress.add_task("decode", total=len(configs)) if ctx.progress is not None else None
    loaded = ctx.loaded
    if config.decode_weights:  # a second copy of the model, quantized (the first stays the quality reference)
        loaded = load_model(config.model, dtype=DTYPES[config.dtype])
        quantize_loaded(loaded, quant_config(config.decode_weights), progress=False)
    engines = {}
    for name, kv in configs:
        engine = measurement_engine(
            loaded, kv, config.decode_context + config.decode_tokens + 2, config.block_size
        )
        if config.decode_context + config.decode_tokens + 1 > engine.max_model_len:
            raise ValueError(
                f"--decode-context {config.decode_context} + {config.decode_tokens} tokens exceed this "
                f"model's context of {engine.max_model_len}; lower --decode-context"
            )
        engines[name] = engine
    # side by side: the engines take turns step by step, so machine noise hits every config alike
    measured = context_speeds(engines, config.decode_context, config.decode_tokens, config.seed)
    speeds, prefill = measured.decode, measured.prefill
    for name, engine in engines.items():
        ctx.records.append(
            {
                "kind": "decode",
                "config": name,
                "context": config.decode_context,
                "tok_per_s": speeds[name],
                "prefill_tok_per_s": prefill[name],
                "eviction": engine.evictor.report() if engine.evictor is not None else None,  # host time
            }
        )
        if ctx.progress is not None:
            ctx.progress.advance(task)
    return {
        "tok_per_s": speeds,
        "evict_config": evict,
        "speedup": speeds[evict] / speeds["uncompressed"],
        "vs_uncompressed": {n: speeds[n] / speeds["uncompressed"] for n in speeds},
        "prefill_tok_per_s": prefill,
        "prefill_vs_uncompressed": {n: prefill[n] / prefill["uncompressed"] for n in prefill},
    }


# ---- the run ------------------------------------------------------------------------------------------
def run_kv(
    config: KVBenchConfig | None = None, progress: Any = None, say: Callable[[str], None] | None = None
) -> BenchRun:
    """Run every part; ``say`` gets one-line status messages (the time estimate, skipped codecs)."""
    config = config or KVBenchConfig()
    say = say or (lambda _message: None)
    t_start = time.perf_counter()
    loaded = load_model(config.model, dtype=DTYPES[config.dtype])
    load_s = time.perf_counter() - t_start
    codecs = [
        codec_of(n, config.identity) for n in (*config.codecs, *config.retrieval_configs, *config.combined)
    ]
    skipped = unavailable_codecs(list(dict.fromkeys(codecs)), config.block_size)
    ctx = _Context(config, loaded, kv_bytes_per_token(loaded.config, None, torch.bfloat16), progress, skipped)
    for name, why in skipped.items():
        ctx.notes.append(f"{name} skipped: its encode/decode does not run on this device ({why})")
        say(ctx.notes[-1])
    grid = [(n, kv) for n, kv in config.grid() if codec_of(n, config.identity) not in skipped]
    if not grid:
        raise ValueError("every config was skipped on this device; choose other --codecs or add --policies")
    if config.text == "sharegpt" and loaded.tokenizer is None:
        ctx.notes.append("the model has no tokenizer: random token ids instead of ShareGPT text")
    ref = measurement_engine(loaded, None, config.context_tokens, config.block_size)
    if config.context_tokens > ref.max_model_len:
        raise ValueError(
            f"--context-tokens {config.context_tokens} exceeds this model's context of "
            f"{ref.max_model_len} tokens"
        )

    probe_prompt = min(PROMPT_CHUNK, config.prompt_len)
    speed = _probe(ref, probe_prompt, min(config.chunk_size, config.context_tokens - probe_prompt))
    group = _group_size(ctx, len(grid))
    estimate = estimate_seconds(config, len(grid), cdiv(len(grid), group), speed)
    say(
        f"estimate: ~{sum(estimate.values()) / 60:.1f} min (quality {estimate['quality']:.0f} s, retrieval "
        f"{estimate['retrieval']:.0f} s, decode {estimate['decode']:.0f} s) from a probe: "
        f"{1 / speed.per_token:.0f} prefill tok/s, {speed.per_chunk * 1e3:.0f} ms per "
        f"{config.chunk_size}-token chunk, {speed.per_step * 1e3:.0f} ms per decode step; attention growth "
        "and eviction scoring come on top"
    )

    timings: dict[str, float] = {"load": load_s}
    t0 = time.perf_counter()
    sequences = token_sequences(
        config.text,
        loaded.tokenizer,
        loaded.config.vocab_size,
        config.num_sequences,
        config.context_tokens,
        config.seed,
    )
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    if bos is not None and getattr(loaded.tokenizer, "add_bos", False) and config.text == "sharegpt":
        sequences = [[bos, *s[1:]] for s in sequences]  # a document start, as llama.cpp's windows
    quality = _quality(ctx, ref, grid, sequences, group)
    del ref
    timings["quality"] = time.perf_counter() - t0
    peer = None
    if config.llama_cpp_kv:
        t0 = time.perf_counter()
        peer = _llama_cpp_kv(ctx, sequences)
        timings["llama_cpp_kv"] = time.perf_counter() - t0
    retrieval = None
    if config.retrieval_seeds and config.retrieval_configs:
        t0 = time.perf_counter()
        retrieval = _retrieval(ctx)
        timings["retrieval"] = time.perf_counter() - t0
    memory = _memory(ctx)
    decode = None
    if config.decode_context:
        t0 = time.perf_counter()
        decode = _decode(ctx)
        timings["decode"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start

    aggregates: dict[str, Any] = {
        "text": "held-out ShareGPT"
        if config.text == "sharegpt" and loaded.tokenizer is not None
        else "random token ids",
        "quality": quality["rows"],
        "llama_cpp_kv": peer,  # llama.cpp's KV types, each against its own f16 cache; None: not run
        "lockstep_group_size": quality["group_size"],
        "retrieval": retrieval,
        "memory": memory,
        "decode": decode,
        "seconds": timings,
        "estimate_seconds": estimate,
        "probe_seconds": asdict(speed),
        "skipped_codecs": skipped,
    }
    aggregates["targets"] = targets(aggregates)
    ctx.notes += notes(config, loaded, retrieval, grid)
    run = BenchRun(
        kind="kv",
        command=config.command(),
        config=asdict(config),
        records=ctx.records,
        aggregates=aggregates,
        notes=ctx.notes,
        machine=machine_info(),
    )
    run.tables = tables(config, aggregates)
    return run
