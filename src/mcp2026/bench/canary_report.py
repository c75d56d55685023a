"""The canary report: the verdict and every metric's evidence (value, interval, samples, thresholds, reason),
as JSON for machines and markdown for people, written side by side as ``<time>-canary.json`` / ``.md``."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mcp2026.bench.canary_run import CanaryResult
from mcp2026.bench.report import Table, machine_info, machine_line, markdown_table, project_root
from mcp2026.canary.bandwidth import ASSUMPTIONS

LABELS = {
    "p99_ttft_change": "P99 TTFT change",
    "p99_e2e_change": "P99 E2E change",
    "ppl_change": "accuracy: perplexity change",
    "bandwidth_utilisation": "candidate memory bandwidth utilisation",
}


def report_dict(result: CanaryResult, machine: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "kind": "canary",
        "created_at": result.created_at,
        "command": result.settings.command(),
        **result.gate.to_dict(),
        "thresholds": result.thresholds.to_dict(),
        "settings": asdict(result.settings),
        "arms": result.arms,
        "workload": result.workload,
        "block_order": result.block_order,
        "latency": result.latency,
        "accuracy": None if result.accuracy is None else result.accuracy.to_dict(),
        "greedy_agreement": result.agreement,
        "bandwidth": {name: b.to_dict() for name, b in result.bandwidth.items()},
        "bandwidth_assumptions": list(ASSUMPTIONS),
        "seconds": result.seconds,
        "machine": machine if machine is not None else machine_info(),
        "records": result.records,
    }


def _num(x: Any, spec: str = ".3g") -> str:
    return "—" if x is None else format(x + 0.0, spec)  # + 0.0: no "-0"


def _metrics_table(report: dict[str, Any]) -> Table:
    confidence = report["thresholds"]["confidence"]
    rows = []
    for m in report["metrics"]:
        interval = "—" if m["low"] is None else f"[{_num(m['low'], '+.4g')}, {_num(m['high'], '+.4g')}]"
        worse_up = m["kind"] != "accuracy"
        rows.append(
            [
                f"{LABELS.get(m['name'], m['name'])} ({m['unit']})",
                _num(m["value"], "+.4g"),
                interval,
                str(m["num_samples"]),
                f"{'<=' if worse_up else '>='} {m['safe']:+g}",
                f"{'>' if worse_up else '<'} {m['trip']:+g}",
                f"**{m['status']}**",
                m["reason"],
            ]
        )
    columns = ["metric", "value", f"{confidence:.0%} interval", "samples", "safe", "trip", "status", "reason"]
    return Table("Release metrics", columns, rows)


def render_markdown(report: dict[str, Any]) -> str:
    wl, arms = report["workload"], report["arms"]
    lines = [
        f"# Canary: {report['verdict']} (exit {report['exit_code']})",
        "",
        f"Baseline `{arms['baseline']['config']}` vs candidate `{arms['candidate']['config']}`: "
        f"{wl['num_requests']} {wl['name']} requests (mean prompt {wl['mean_prompt_len']:.0f} tokens, "
        f"{wl['mean_output_len']:.0f} output tokens, greedy, EOS ignored) in {wl['num_blocks']} blocks of "
        f"{wl['block_size']}, interleaved {' '.join(report['block_order'])} (A = baseline, B = candidate); "
        f"{report['seconds']:.0f} s.",
        "",
        "## Release metrics",
        "",
        markdown_table(_metrics_table(report)),
        "",
        "PROMOTE needs every metric safe, any trip is ROLLBACK, anything else HOLD. A metric is safe only if its "
        "whole interval is on the safe side, trips only if its whole interval is beyond the trip threshold.",
        "",
    ]
    lines += _latency_lines(report)
    lines += _accuracy_lines(report)
    lines += _bandwidth_lines(report)
    lines += _arms_lines(report)
    lines += [
        f"Command: `{report['command']}`",
        "",
        f"Machine: {machine_line(report['machine'])}; run {report['created_at']}.",
        "",
    ]
    return "\n".join(lines)


def _latency_lines(report: dict[str, Any]) -> list[str]:
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_e2e_ms", "p99_e2e_ms")
    rows = [
        [arm, s["num_requests"], s["num_failed"], *(s[k] for k in keys)]
        for arm, s in report["latency"].items()
    ]
    columns = ["arm", "requests", "failed", "p50 TTFT", "p99 TTFT", "p50 E2E", "p99 E2E"]
    return ["## Latency per arm (ms)", "", markdown_table(Table("", columns, rows)), ""]


def _accuracy_lines(report: dict[str, Any]) -> list[str]:
    acc, agree = report["accuracy"], report["greedy_agreement"]
    lines = ["## Accuracy", ""]
    if acc is None:
        lines += ["Not measured (--eval-windows 0).", ""]
    else:
        lines += [
            f"Held-out ShareGPT text, {acc['num_windows']} windows x {acc['n_ctx']} tokens, second halves scored "
            f"({acc['num_tokens']} tokens, {acc['num_blocks']} bootstrap blocks) through each arm's paged KV path "
            f"in chunks of {acc['chunk_size']} token(s). The perplexity change drives the verdict.",
            "",
            markdown_table(
                Table(
                    "",
                    [
                        "PPL baseline",
                        "PPL candidate",
                        "change %",
                        "KLD (nats/token)",
                        "KLD p99",
                        "top-1 agreement",
                    ],
                    [
                        [
                            acc["baseline_ppl"],
                            acc["candidate_ppl"],
                            acc["ppl_change_pct"],
                            acc["kld"],
                            acc["kld_p99"],
                            acc["top1_agreement"],
                        ]
                    ],
                )
            ),
            "",
        ]
    lines += [
        f"Greedy outputs on the workload ({agree['num_requests']} requests, cut after the first EOS): identical "
        f"{_num(agree['identical_share'], '.1%')}, mean matching leading tokens "
        f"{_num(agree['mean_matching_prefix_share'], '.1%')} (evidence, not gated).",
        "",
    ]
    return lines


def _bandwidth_lines(report: dict[str, Any]) -> list[str]:
    rows = []
    for arm, b in report["bandwidth"].items():
        rows.append(
            [
                arm,
                b["weight_bytes_per_step"] / 2**20,
                b["kv_bytes_per_token"],
                b["decode_steps"],
                b["decode_seconds"],
                None if b["bytes_per_s"] is None else b["bytes_per_s"] / 1e9,
                b["peak_bytes_per_s"] / 1e9,
                b["utilisation_pct"],
            ]
        )
    columns = [
        "arm",
        "weights MiB/step",
        "KV bytes/token",
        "decode steps",
        "decode s",
        "GB/s",
        "peak GB/s",
        "utilisation %",
    ]
    return [
        "## Memory bandwidth (estimate; the candidate's is gated)",
        "",
        markdown_table(Table("", columns, rows)),
        "",
        *(f"- {a}" for a in report["bandwidth_assumptions"]),
        "",
    ]


def _arms_lines(report: dict[str, Any]) -> list[str]:
    def quant(a: dict[str, Any]) -> str:
        q = a["quant"]
        return "none" if q is None else f"{q['target_precision']} ({q['yaml']})"

    def kv(a: dict[str, Any]) -> str:
        c = a["kv_compressor"]
        return "as the model dtype" if c is None else f"{c['dtype']}, eviction {c['policy']}"

    rows = [
        ["model", *(a["model"] for a in report["arms"].values())],
        ["dtype", *(a["dtype"] for a in report["arms"].values())],
        ["weight quantization", *(quant(a) for a in report["arms"].values())],
        ["KV cache", *(kv(a) for a in report["arms"].values())],
        ["scheduler max_num_seqs", *(a["scheduler"]["max_num_seqs"] for a in report["arms"].values())],
    ]
    return ["## Arms", "", markdown_table(Table("", ["", *report["arms"]], rows)), ""]


def write_report(result: CanaryResult, out_dir: Path | None = None) -> tuple[Path, Path, dict[str, Any]]:
    """Write ``<out>/<time>-canary.json`` and ``.md`` (default out: runs/); returns both paths and the dict."""
    out = Path(out_dir) if out_dir is not None else project_root() / "runs"
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{time.strftime('%Y%m%d-%H%M%S')}-canary"
    n = 1
    while base.with_suffix(".json").exists():
        n += 1
        base = out / f"{time.strftime('%Y%m%d-%H%M%S')}-canary-{n}"
    report = report_dict(result)
    json_path, md_path = base.with_suffix(".json"), base.with_suffix(".md")
    json_path.write_text(json.dumps(report, indent=1, default=str))
    md_path.write_text(render_markdown(report))
    return json_path, md_path, report
