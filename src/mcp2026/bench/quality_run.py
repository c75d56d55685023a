"""``mcp2026 bench quality`` as a run JSON (kind "quality"), so the headline table can show weight-quantization
quality next to speed: per plan its bits/weight, ΔPPL (± 1 s.e.) and KLD vs the unquantized model."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mcp2026.bench.report import BenchRun, Table, format_value, machine_info

# The plans the headline shows: the claims the product makes (int8 near-lossless, the DQG at its budgets against
# uniform int4 and the llama.cpp-style role mixture at the same bits).
HEADLINE_FIXED = ("int8", "int4 sym g32", "int4 asym g32")


def headline_plans(plans: dict[str, dict[str, Any]], budgets: tuple[float, ...]) -> list[str]:
    wanted = {f"{family} {b:.3g} bpw" for family in ("DQG", "DQG-sym") for b in budgets}
    return [
        name
        for name in plans
        if name in HEADLINE_FIXED or name in wanted or name.startswith("llama.cpp-style mixture")
    ]


def quality_run(result: Any, settings: Any, command: str, model: Any = None) -> BenchRun:
    """``result``: a ``bench.quant_quality.QualityBench``; ``settings`` the ``QualityBenchSettings`` it ran with."""
    reference = next((r for r in result.rows if r["family"] == "reference"), {})
    keys = (
        "family",
        "bits",
        "mib",
        "ppl",
        "delta_ppl",
        "delta_ppl_stderr",
        "kld",
        "kld_p99",
        "top1_agreement",
    )
    plans = {
        r["plan"]: {k: r.get(k) for k in keys}
        for r in result.rows
        if r["family"] not in ("reference", "peer", "llama.cpp")
    }
    peers = {
        r["plan"]: {k: r.get(k) for k in keys} for r in result.rows if r["family"] in ("peer", "llama.cpp")
    }
    config = {**asdict(settings), "model": str(model) if model else None}
    headline = headline_plans(plans, tuple(settings.dqg_budgets))
    table = Table(
        "Weight quantization quality vs fp32",
        ["plan", "bits/weight", "ΔPPL", "KLD"],
        [
            [name, format_value(p["bits"]), delta_text(p), format_value(p["kld"])]
            for name, p in {**plans, **peers}.items()
        ],
    )
    return BenchRun(
        kind="quality",
        command=command,
        config=config,
        records=list(result.rows),
        aggregates={
            "reference_ppl": reference.get("ppl"),
            "scored_tokens": reference.get("num_tokens"),
            "plans": plans,
            "peers": peers,  # other engines on the same windows, against the same reference
            "headline": headline,
            # bits per linear of the headline's DQG plans: `bench report` draws them as heatmaps
            "layer_bits": {
                r["plan"]: r["layer_bits"]
                for r in result.rows
                if r.get("layer_bits") and r["plan"] in headline and str(r["family"]).startswith("DQG")
            },
        },
        tables=[table],
        notes=list(getattr(result, "notes", [])),
        machine=machine_info(),
    )


def delta_text(plan: dict[str, Any]) -> str:
    delta, stderr = plan.get("delta_ppl"), plan.get("delta_ppl_stderr")
    if not isinstance(delta, (int, float)):
        return "—"
    text = f"{100 * delta:+.2f}%"
    return text + (f" ± {100 * stderr:.2f}" if isinstance(stderr, (int, float)) else "")
