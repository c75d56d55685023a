"""The headline table of docs/benchmarks.md, rebuilt from run JSONs: the newest run of each kind, one row per
claim (ours, each peer, ours / peer, the run's own command). Every number is read from a run's aggregates;
a row whose numbers are not there is left out. A kind with no run given keeps its rows (and its "runs used"
lines) from the previous table, said so under it: `make bench` cannot rerun the serving runs (they need the peer
servers up), and a fresh checkout has no runs/, so regenerating must not silently drop what it cannot remeasure.
``mcp2026 bench headline`` (bench/headline_cli.py) drives it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from mcp2026.bench.quality_run import delta_text
from mcp2026.bench.report import BenchRun, format_value, machine_line

KINDS = ("latency", "offline-batched-decode", "offline", "serve", "kv", "quality")
PEERS = ("HF transformers", "llama.cpp", "vLLM")  # the peer columns, in order
SHORT = {"HF transformers": "HF", "llama.cpp": "llama.cpp", "vLLM": "vLLM"}
COLUMNS = ["what", "ours", *PEERS, "ratios (ours / peer)", "command"]
LATENCY_ENGINES = {"hf": "HF transformers", "llama.cpp": "llama.cpp"}
Peer = tuple[str, Any, str]  # (a PEERS column or a free name, value, qualifier shown after the value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def _text(value: Any, unit: str) -> str:
    number = _number(value)
    return "—" if number is None else f"{format_value(number)}{unit}"


def _row(what: str, ours: Any, peers: Iterable[Peer], unit: str, command: str) -> list[str] | None:
    """One table row; ratios are ours / peer of the values shown. None when ours has no number."""
    mine = _number(ours)
    if mine is None:
        return None
    cells = dict.fromkeys(PEERS, "—")
    ratios = []
    for name, value, qualifier in peers:
        peer = _number(value)
        shown = _text(peer, unit) + (f" ({qualifier})" if qualifier and peer is not None else "")
        ratio = f"{mine / peer:.2f}x" if peer else "—"
        if name in cells:
            cells[name] = shown if cells[name] == "—" else f"{cells[name]}; {shown}"
            if peer:
                ratios.append(f"{ratio} {SHORT[name]}")
        elif peer is not None:  # a serving peer of no known engine: its value goes with its ratio
            ratios.append(f"{ratio} {name} ({shown})")
    return [what, _text(mine, unit), *cells.values(), ", ".join(ratios) or "—", _command(command)]


def _command(command: str) -> str:
    return f"`{command}`" if command else "—"


def latency_rows(run: BenchRun) -> list[list[str]]:
    """Per format of ours (``median_tok_per_s["mcp2026/<fmt>"]``): decode, then prefill, vs HF at the same
    dtype (else HF fp32) and llama.cpp's GGUF."""
    medians = run.aggregates.get("median_tok_per_s") or {}
    new, prefill = run.config.get("new_tokens"), run.config.get("prefill_tokens")
    rows = []
    for metric, what, tokens in (("decode", "single-stream decode", new), ("prefill", "prefill", prefill)):
        for key, ours in medians.items():
            engine, _, fmt = key.partition("/")
            if engine != "mcp2026":
                continue
            peers = []
            hf = next((k for k in (f"hf/{fmt}", "hf/fp32") if k in medians), None)
            hf = hf or next((k for k in medians if k.startswith("hf/")), None)
            for peer_key in (hf, "llama.cpp/gguf"):
                if peer_key in medians:
                    peer_engine, _, peer_fmt = peer_key.partition("/")
                    peers.append((LATENCY_ENGINES[peer_engine], medians[peer_key].get(metric), peer_fmt))
            label = f"{what} tok/s, {fmt}" + (f" ({tokens} tokens)" if tokens else "")
            per_step = ours.get("tokens_per_step") or 1.0
            if metric == "decode" and per_step > 1.005:  # NaN compares False
                label += f", prompt-lookup drafting as by default: {per_step:.2f} tokens per step"
            row = _row(label, ours.get(metric), peers, "", run.command)
            rows += [row] if row else []
    return rows


def offline_rows(run: BenchRun) -> list[list[str]]:
    """``aggregates.mcp2026`` (and each quantized run of ours, ``aggregates["mcp2026-<fmt>"]``) vs
    ``aggregates.hf``: decode tok/s at N sequences (batched decode), output tok/s over the workload (offline)."""
    agg, config = run.aggregates, run.config
    hf = agg.get("hf") or {}
    if run.kind == "offline-batched-decode":
        n = config.get("batched_decode")
        what = f"batched decode{f' at {n} concurrent sequences' if n else ''}, decode tok/s"
        key, qualifier = "decode_tok_per_s", f"static batch {n}" if n else ""
    else:
        requests = (agg.get("workload") or {}).get("num_requests")
        name = config.get("workload", "offline")
        what = f"{name} offline{f', {requests} requests' if requests else ''}, output tok/s"
        batch = config.get("batch_size")
        key, qualifier = "output_tok_per_s", f"static batches of {batch}" if batch else ""
    dtype = config.get("resolved_dtype") or config.get("dtype") or ""
    peers = [("HF transformers", hf.get(key), f"{dtype}, {qualifier}" if dtype else qualifier)] if hf else []
    for name, column, what_ran in (("llama.cpp", "llama.cpp", "gguf, batch API"), ("vllm", "vLLM", "bf16")):
        if agg.get(name):
            peers.append((column, agg[name].get(key), what_ran))
    rows = []
    for engine in ["mcp2026", *(f"mcp2026-{fmt}" for fmt in config.get("weights") or ())]:
        weights = f"{engine.removeprefix('mcp2026-')} weights" if engine != "mcp2026" else dtype
        label = f"{what}{f', ours {weights}' if weights else ''}"
        row = _row(label, (agg.get(engine) or {}).get(key), peers, "", run.command)
        rows += [row] if row else []
    return rows


def serve_column(name: str) -> str:
    """The peer column a serving peer's name falls in (its own name when none)."""
    low = name.lower()
    if "vllm" in low:
        return "vLLM"
    if "llama" in low:
        return "llama.cpp"
    if low in ("hf", "transformers") or "transformers" in low:
        return "HF transformers"
    return name


def serve_rows(run: BenchRun) -> list[list[str]]:
    """``aggregates.endpoints[name]`` (a run without peers: the top-level aggregates are ours): output tok/s
    and TTFT median per endpoint."""
    agg = run.aggregates
    endpoints = agg.get("endpoints") or {"mcp2026": agg}
    ours = endpoints.get("mcp2026") or {}
    concurrency, rate = run.config.get("max_concurrency"), _rate(run)
    where = f"serving{f', {concurrency} concurrent clients' if concurrency else ''}"
    measures = [
        ("output_throughput", f"{where}, output tok/s", ""),
        ("median_ttft_ms", f"{where}, TTFT median (lower is better)", " ms"),
    ]
    if rate is not None:  # paced arrivals: the claim is goodput at that rate
        where = f"serving at {rate:g} req/s (Poisson, <= {concurrency} concurrent)"
        measures = [
            ("request_goodput", f"{where}, goodput req/s", ""),
            ("median_tpot_ms", f"{where}, TPOT median (lower is better)", " ms"),
        ]
    rows = []
    for key, what, unit in measures:
        peers = [(serve_column(n), e.get(key), n) for n, e in endpoints.items() if n != "mcp2026"]
        row = _row(what, ours.get(key), peers, unit, run.command)
        rows += [row] if row else []
    return rows


def kv_rows(run: BenchRun) -> list[list[str]]:
    """Per KV codec in both ``aggregates.quality`` and ``aggregates.memory`` (eviction rows are left out):
    ΔPPL vs uncompressed, bytes per token and max sequences vs bf16."""
    quality, memory = run.aggregates.get("quality") or {}, run.aggregates.get("memory") or {}
    peer = run.aggregates.get("llama_cpp_kv") or {}
    tokens = run.config.get("context_tokens")
    rows = []
    for codec, q in quality.items():
        m = memory.get(codec) or {}
        delta, ratio = _number(q.get("delta_ppl")), _number(m.get("bytes_ratio"))
        if "@" in codec or delta is None or ratio is None:
            continue
        ours = f"ΔPPL {100 * delta:+.2f}%, {ratio:.2f}x fewer bytes/token than bf16"
        seqs = _number(m.get("seqs_ratio"))
        ours += f", {seqs:.2f}x bf16's sequences" if seqs is not None else ""
        theirs, kv_type = "—", LLAMA_KV_PEER.get(codec)
        if kv_type in peer and _number(peer[kv_type].get("delta_ppl")) is not None:
            p = peer[kv_type]
            theirs = f"ΔPPL {100 * p['delta_ppl']:+.2f}% vs its f16 KV ({kv_type}, {p['bytes_ratio']:.2f}x fewer bytes)"
        what = f"{codec} KV cache{f' at {tokens} tokens' if tokens else ''}"
        rows.append([what, ours, "—", theirs, "—", "—", _command(run.command)])
    return rows


LLAMA_KV_PEER = {"int8": "q8_0", "int4": "q4_0"}  # our codec -> llama.cpp's cache type of about its size


def quality_rows(run: BenchRun) -> list[list[str]]:
    """The plans the run marked for the headline (``aggregates.headline``): ΔPPL ± 1 s.e. and KLD vs the
    unquantized model at the plan's bits/weight (scales and zero points counted)."""

    plans = run.aggregates.get("plans") or {}
    windows = run.config.get("num_windows")
    rows = []
    peers = run.aggregates.get("peers") or {}
    if peers:  # the reference's perplexity next to the peers' on the same windows
        columns = {"HF transformers": "HF", "llama.cpp": "llama.cpp"}
        shown = [(col, p.get("ppl"), _peer_label(name)) for name, p in peers.items()
                 for col, prefix in columns.items() if name.startswith(prefix)]  # fmt: skip
        what = "perplexity of the model, ours fp32" + (
            f" ({windows} windows; lower is better)" if windows else ""
        )
        row = _row(what, run.aggregates.get("reference_ppl"), shown, "", run.command)
        rows += [row] if row else []
    for name in run.aggregates.get("headline") or []:
        plan = plans.get(name) or {}
        bits, kld = _number(plan.get("bits")), _number(plan.get("kld"))
        if bits is None or _number(plan.get("delta_ppl")) is None:
            continue
        ours = f"ΔPPL {delta_text(plan)}" + (f", KLD {format_value(kld)}" if kld is not None else "")
        what = f"weights {name}, {bits:.2f} bits/weight" + (f" ({windows} windows)" if windows else "")
        rows.append([what, ours, "—", "—", "—", "—", _command(run.command)])
    return rows


def _peer_label(name: str) -> str:
    """ "llama.cpp, X.gguf as stored (peer)" -> "X.gguf as stored"; "HF transformers fp32 (peer)" -> "fp32"."""
    label = name.removesuffix(" (peer)")
    return label.split(", ", 1)[1] if ", " in label else label.removeprefix("HF transformers ").strip()


ROWS = {
    "latency": latency_rows,
    "offline-batched-decode": offline_rows,
    "offline": offline_rows,
    "serve": serve_rows,
    "kv": kv_rows,
    "quality": quality_rows,
}


def _time(run: BenchRun) -> datetime | None:
    try:
        return datetime.strptime(run.created_at, "%Y-%m-%dT%H:%M:%S%z")
    except (TypeError, ValueError):
        return None


def _rate(run: BenchRun) -> float | None:
    """The run's paced request rate; None for as-fast-as-possible (inf) or none given."""
    rate = _number(run.config.get("request_rate"))
    return rate if rate is not None and rate != float("inf") else None


def group_of(run: BenchRun) -> str:
    """What "the newest run" is taken per: the kind, and for serving also the concurrency and a paced request
    rate (16 and 32 concurrent clients, and goodput at 0.1 req/s, are separate claims), and for a paced run its
    peers (goodput vs llama-server and vs vLLM at one rate are two claims)."""
    if run.kind != "serve":
        return run.kind
    concurrency, rate = run.config.get("max_concurrency"), _rate(run)
    group = f"{run.kind} @{concurrency}" if concurrency else run.kind
    if rate is None:
        return group
    peers = sorted(p.get("name", "") for p in run.config.get("peers") or [] if isinstance(p, dict))
    return f"{group} @{rate:g}req/s" + (f" vs {','.join(peers)}" if peers else "")


def newest_per_kind(runs: list[BenchRun]) -> dict[str, BenchRun]:
    """The newest run of each known kind (serving: kind and concurrency) by ``created_at``; on a tie (or no
    readable time) the later in ``runs`` wins, so pass files in name order."""
    newest: dict[str, BenchRun] = {}
    for run in runs:
        if run.kind not in ROWS:
            continue
        group = group_of(run)
        best = newest.get(group)
        t, best_t = _time(run), _time(best) if best else None
        if best is None or t is None or best_t is None or t >= best_t:
            newest[group] = run
    return newest


def _concurrency(group: str) -> tuple[int, str]:
    """Sort key of serving groups: by concurrency, paced runs after their unpaced sibling."""
    parts = group.split(" @")
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0, " @".join(parts[2:]))


_COMMAND_CELL = re.compile(r"`mcp2026 bench (\S+)([^`]*)`")
KEPT = " (kept from the previous table)"


def row_kind(line: str) -> str | None:
    """The kind of a rendered table row, read from its command cell; None for a row without one."""
    match = _COMMAND_CELL.search(line)
    if match is None:
        return None
    kind = match.group(1)
    if kind == "offline" and "--batched-decode" in match.group(2):
        kind = "offline-batched-decode"
    return kind if kind in KINDS else None


def _run_line_kind(line: str) -> str:
    # "- serve @16 @0.51req/s vs llama: run ..." -> "serve"
    return line[2:].split(":", 1)[0].split(" ", 1)[0]


def kept_lines(previous: str, kinds: Iterable[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Per kind in ``kinds`` found in the previous table: its row lines and its "runs used" lines."""
    lines = previous.splitlines()
    kept = {}
    for kind in kinds:
        rows = [line for line in lines if line.startswith("| ") and row_kind(line) == kind]
        used = [line for line in lines if line.startswith("- ") and _run_line_kind(line) == kind]
        if rows:
            kept[kind] = (rows, [line if line.endswith(KEPT) else line + KEPT for line in used])
    return kept


def _render(row: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"


def headline_markdown(runs: list[BenchRun], previous: str = "") -> str:
    """The headline table from the newest run of each kind, a line per run used and the kinds not found;
    a kind with no run keeps its rows from ``previous`` (the current section's text), when there."""
    newest = newest_per_kind(runs)
    found = {run.kind for run in newest.values()}
    kept = kept_lines(previous, [k for k in KINDS if k not in found])
    rows, used = [], []
    for kind in KINDS:
        if kind in kept:
            rows += kept[kind][0]
            used += kept[kind][1]
            continue
        for g in sorted((g for g in newest if newest[g].kind == kind), key=_concurrency):
            rows += [_render(row) for row in ROWS[kind](newest[g])]
            used.append(f"- {g}: run {newest[g].created_at}; {machine_line(newest[g].machine)}")
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
        *rows,
        "",
        "Ratios are ours / peer of the values shown: above 1, ours is higher (better for tok/s, worse for TTFT).",
        "Runs used (the newest of each kind):",
        "",
        *used,
        "",
    ]
    if kept:
        lines += [f"Kept from the previous table (no run of that kind given): {', '.join(kept)}.", ""]
    missing = [k for k in KINDS if k not in found and k not in kept]
    if missing:
        lines += [f"Not in this table (no run found): {', '.join(missing)}.", ""]
    return "\n".join(lines) + "\n"
