"""Tables, targets and notes of ``mcp2026 bench kv``: the product's targets with PASS/MISS next to the
measured value (or "not measured" when that part did not run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcp2026 import hardware
from mcp2026.bench.kv_config import PROMPT_CHUNK, KVBenchConfig
from mcp2026.bench.report import Table
from mcp2026.kv.codecs import describe_default_block_sizes
from mcp2026.kv.layer_weights import AUTO, auto_weights


@dataclass(frozen=True)
class Target:
    """One of the product's targets: ``config``'s ``metric`` must be >= (``at_least``) or <= ``bound``."""

    config: str
    metric: str
    bound: float
    at_least: bool
    label: str

    def verdict(self, value: float | None) -> str:
        if value is None or value != value:
            return f"{self.label}: not measured"
        ok = value >= self.bound if self.at_least else value <= self.bound
        return f"{self.label}: {'PASS' if ok else 'MISS'}"


QUALITY_TARGETS = (
    Target("int8", "delta_ppl", 0.001, False, "ΔPPL ≤ 0.1%"),
    Target("int4", "delta_ppl", 0.02, False, "ΔPPL ≤ 2%"),
    Target("int4", "bytes_ratio", 3.5, True, "≥ 3.5x fewer bytes"),
    Target("heavy_hitter@0.7", "delta_ppl", 0.05, False, "ΔPPL ≤ 5%"),
    Target("heavy_hitter@0.7", "retrieval_agreement", 0.9, True, "answer agreement ≥ 90% (same answer)"),
)
CONCURRENCY_TARGET = Target("int4", "seqs_ratio", 3.0, True, "≥ 3x bf16's sequences")
DECODE_TARGET = Target("evict", "speedup", 1.5, True, "≥ 1.5x uncompressed")


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{x * 100:+.3g}%"


def metric(aggregates: dict[str, Any], target: Target) -> float | None:
    if target is CONCURRENCY_TARGET:
        row = aggregates["memory"].get(target.config)
        return row["seqs_ratio"] if row else None
    if target is DECODE_TARGET:
        return aggregates["decode"]["speedup"] if aggregates["decode"] else None
    if target.metric == "retrieval_agreement":
        scores = (aggregates["retrieval"] or {}).get("scores", {})
        return scores[target.config]["agreement"] if target.config in scores else None
    row = aggregates["quality"].get(target.config)
    return row[target.metric] if row else None


def target_config(name: str) -> str:
    """The config whose targets a row answers to: its own, or for a policy row with KVCompressor options, stored
    as the model computes them (``fp32+heavy_hitter@0.7:layer_weights=...``), the policy's at that sparsity: it
    is that policy at that budget, tuned."""
    codec, plus, rest = name.partition("+")
    if plus and codec in ("fp32", "bf16"):
        name = rest
    return name.partition(":")[0] if "@" in name else name


def _answering(aggregates: dict[str, Any], candidates: Sequence[Target]) -> list[Target]:
    """``candidates`` for their own configs, and again for every measured row that answers to them."""
    rows = {*aggregates["quality"], *((aggregates.get("retrieval") or {}).get("scores", {}))}
    tuned = [
        dataclasses.replace(t, config=name)
        for name in sorted(rows)
        if target_config(name) != name
        for t in candidates
        if t.config == target_config(name)
    ]
    return [*candidates, *tuned]


def targets(aggregates: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t in (*_answering(aggregates, QUALITY_TARGETS), CONCURRENCY_TARGET, DECODE_TARGET):
        value = metric(aggregates, t)
        out.append({"config": t.config, "target": t.label, "value": value, "verdict": t.verdict(value)})
    return out


def _verdicts(aggregates: dict[str, Any], config: str, targets: Sequence[Target]) -> str:
    answered = [
        t if t.config == config else dataclasses.replace(t, config=config)
        for t in targets
        if t.config in (config, target_config(config))
    ]
    return "; ".join(t.verdict(metric(aggregates, t)) for t in answered) or ""


def tables(config: KVBenchConfig, agg: dict[str, Any]) -> list[Table]:
    return [
        _quality_table(config, agg),
        *([_llama_cpp_table(config, agg)] if agg.get("llama_cpp_kv") else []),
        _memory_table(config, agg),
        *([_decode_table(config, agg["decode"])] if agg["decode"] else []),
    ]


def _quality_table(config: KVBenchConfig, agg: dict[str, Any]) -> Table:
    quality, retrieval = agg["quality"], agg["retrieval"]
    scores = retrieval["scores"] if retrieval else {}

    def count(name: str, key: str, of: str = "num_prompts") -> str:
        s = scores.get(name)
        return f"{s[key]}/{s[of]}" if s and of in s else "—"

    ref = agg["memory"][config.identity]
    rows: list[list[Any]] = [
        [
            f"uncompressed ({config.identity} KV)",
            _pct(0.0),
            _pct(0.0),
            0.0,
            1.0,
            ref["kv_bytes_per_token"],
            f"{ref['bytes_ratio']:.2f}x",
            "—",  # the reference itself
            "—",
            count("uncompressed", "num_correct"),
            "—",
            "",
        ]
    ]
    for name, q in quality.items():
        rows.append(
            [
                name,
                _pct(q["delta_ppl"]),
                _pct(q.get("delta_ppl_after_prompt")),
                q["kld"],
                q["top1_agreement"],
                q["kv_bytes_per_token"],
                f"{q['bytes_ratio']:.2f}x",
                count(name, "num_agree"),
                count(name, "num_identical"),
                count(name, "num_correct"),
                count(name, "num_kept", "num_ref_correct"),
                _verdicts(agg, name, QUALITY_TARGETS),
            ]
        )
    for name in scores:  # checked for retrieval only: no quality columns, but their answers count
        if name != "uncompressed" and name not in quality:
            rows.append(
                [name, *["—"] * 6, count(name, "num_agree"), count(name, "num_identical"),
                 count(name, "num_correct"), count(name, "num_kept", "num_ref_correct"),
                 _verdicts(agg, name, [t for t in QUALITY_TARGETS if t.metric == "retrieval_agreement"])]
            )  # fmt: skip
    first = next(iter(quality.values()))
    title = (
        f"KV compression quality: {config.num_sequences} x {config.context_tokens} tokens of {agg['text']} "
        f"({first['num_tokens']} scored, reference PPL {first['ppl_ref']:.3g})"
    )
    if retrieval:
        title += f"; retrieval: {retrieval['mean_prompt_len']:.0f}-token prompts"
    columns = [
        "config",
        "ΔPPL",
        "ΔPPL after prompt",
        "KLD",
        "top-1 agree",
        "KV bytes/token",
        "fewer bytes vs bf16",
        "same answer",
        "same tokens",
        "answer correct",
        "fact kept",
        "target",
    ]
    return Table(title, columns, rows)


def _llama_cpp_table(config: KVBenchConfig, agg: dict[str, Any]) -> Table:
    """llama.cpp's KV types on the same sequences, each against llama.cpp's own f16 cache."""
    peer = agg["llama_cpp_kv"]
    first = next(iter(peer.values()))
    rows = [
        [f"llama.cpp {t}", _pct(q["delta_ppl"]), _pct(q.get("delta_ppl_after_prompt")), q["kld"],
         q["top1_agreement"], f"{q['bytes_ratio']:.2f}x"]
        for t, q in peer.items()
    ]  # fmt: skip
    title = (
        f"The peer: llama.cpp's KV cache types on the same sequences, each against its f16 cache "
        f"({first['num_tokens']} scored, its PPL with f16 K/V {first['ppl_ref']:.3g})"
    )
    columns = ["config", "ΔPPL", "ΔPPL after prompt", "KLD", "top-1 agree", "fewer bytes vs bf16"]
    return Table(title, columns, rows)


def _blocks(block_size: int | None) -> str:
    return (
        f"block size {block_size}"
        if block_size
        else f"each codec's block size: {describe_default_block_sizes()}"
    )


def _memory_table(config: KVBenchConfig, agg: dict[str, Any]) -> Table:
    rows = [
        [
            name,
            m["kv_bytes_per_token"],
            f"{m['bytes_ratio']:.2f}x",
            m["max_sequences"],
            f"{m['seqs_ratio']:.2f}x",
            _verdicts(agg, name, (CONCURRENCY_TARGET,)),
        ]
        for name, m in agg["memory"].items()
    ]
    title = (
        f"Memory: {config.concurrent_len}-token sequences in a {config.budget_gb:g} GB KV pool "
        f"({_blocks(config.block_size)}; computed from block sizes)"
    )
    columns = ["KV storage", "KV bytes/token", "fewer bytes vs bf16", "max sequences", "vs bf16", "target"]
    return Table(title, columns, rows)


def _decode_table(config: KVBenchConfig, decode: dict[str, Any]) -> Table:
    speeds, evict = decode["tok_per_s"], decode["evict_config"]
    prefill = decode.get("prefill_tok_per_s")  # older run JSONs timed decode only

    def row(name: str, target: str) -> list[Any]:
        cells = [name, speeds[name], f"{decode['vs_uncompressed'][name]:.2f}x"]
        if prefill is not None:
            cells += [prefill[name], f"{decode['prefill_vs_uncompressed'][name]:.2f}x"]
        return [*cells, target]

    rows = [row("uncompressed", ""), row(evict, DECODE_TARGET.verdict(decode["speedup"]))]
    rows += [row(name, "") for name in speeds if name not in ("uncompressed", evict)]  # --decode-configs
    title = (
        f"Decode at {config.decode_context} tokens of context ({config.decode_tokens} tokens, one sequence, "
        f"{config.dtype}, {config.decode_weights or config.dtype} weights)"
    )
    if prefill is not None:
        title += "; prefill of that context"
    columns = ["config", "decode tok/s", "vs uncompressed"]
    columns += ["prefill tok/s", "vs uncompressed"] if prefill is not None else []
    return Table(title, [*columns, "target"], rows)


def notes(config: KVBenchConfig, loaded: Any, retrieval: dict | None, grid: list) -> list[str]:
    notes = [
        f"Quality: prompt = first {config.prompt_len} tokens (prefilled in {PROMPT_CHUNK}-token chunks), "
        f"the rest teacher-forced in {config.chunk_size}-token chunks; eviction runs after every chunk "
        "(heavy_hitter keeps a prompt the pool could hold whole until its last chunk). 'ΔPPL after prompt' "
        "scores only the positions after the prompt (what generation sees). "
        f"Eviction rows store K/V as {config.identity}"
        + (
            ", combined rows (CODEC+POLICY) with their codec"
            if any("+" in n for n in (*config.combined, *config.retrieval_configs))
            else ""
        )
        + "; KV bytes/token of an eviction row = pool bytes still held at the end / sequence tokens.",
    ]
    if retrieval:
        notes.append(
            f"Retrieval ({retrieval['mode']}): a fact early in the context, asked at the end; 'same answer' "
            + (
                "= the same code as the uncompressed engine's greedy answer (its first number of 3+ digits; "
                "no code in both counts as the same), "
                if retrieval["mode"] == "text"
                else "= the same first ids as the uncompressed engine's greedy answer (as many as the fact's), "
            )
            + "'same tokens' = identical answer token ids (stricter: it also counts what follows the answer, "
            "a final period or, where neither engine retrieves the fact, unrelated text), 'answer correct' = the answer "
            "contains the fact (a 135M model may not retrieve well even uncompressed), 'fact kept' = correct "
            "where the uncompressed engine was correct."
        )
    auto = _auto_layer_weights(loaded, grid)
    if auto:
        notes.append(auto)
    if any(kv.dtype == "fp8" for _, kv in grid) and next(loaded.model.parameters()).device.type == "cpu":
        notes.append(
            "fp8 on CPU: stored as e4m3 and converted on read (no fp8 arithmetic); saves memory only."
        )
    if config.dtype == "bf16" and not hardware.has_fast_bf16():
        notes.append("bf16 on a CPU without AVX512-BF16/AMX: emulated, several times slower than fp32")
    if config.decode_context:
        notes.append(
            "Decode tok/s: the configs' engines take turns, one decode step each (order rotating), after the "
            "same prompt; each figure is 1 / its median step time, so the ratios hold on a noisy machine better "
            "than the absolute figures do. Prefill tok/s: that prompt's tokens over the summed time of its "
            "chunks, the engines taking turns chunk by chunk (one run each: noisier than decode)."
        )
    return notes


def _auto_layer_weights(loaded: Any, grid: list) -> str | None:
    """What ``layer_weights="auto"`` (a policy row without a layer_weights option) meant on this model."""

    policies = sorted({kv.policy for _, kv in grid if kv.evicts and kv.layer_weights == AUTO})
    if not policies:
        return None
    found = {p: auto_weights(loaded.config, p) for p in policies}
    tuned = [f"{p} the calibrated weights {f[0]!r}" for p, f in found.items() if f]
    uniform = [p for p, f in found.items() if not f]
    said = "; ".join([*tuned, *([f"{', '.join(uniform)} the same budget in every layer"] if uniform else [])])
    return (
        "Per-layer budgets: policy rows without a layer_weights option take the default layer_weights='auto'; "
        f"on this model that gives {said} (kv.layer_weights; ':layer_weights=uniform' asks for the uniform rule)."
    )
