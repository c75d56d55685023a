"""deploy/grafana/mcp2026.json charts only metrics the server exports (a rename must update both)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mcp2026.engine.engine import StepStats
from mcp2026.engine.scheduler import SchedulerStats
from mcp2026.serve.metrics import ServerMetrics
from mcp2026.serve.traffic import TrafficProfile

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "mcp2026.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def exported_names() -> set[str]:
    metrics = ServerMetrics("m", lambda: SchedulerStats(0, 0, 0, 0, 0, 0, 0.0, {"t": 1}))
    metrics.watch_traffic(TrafficProfile().snapshot)
    metrics.watch_engine_time(StepStats)
    return {family.name for family in metrics.registry.collect()}


def test_dashboard_metrics_exist():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {m for e in exprs for m in re.findall(r"mcp2026_\w+", e)}
    names = exported_names()
    for metric in used:
        base = next((metric[: -len(s)] for s in SUFFIXES if metric.endswith(s)), metric)
        assert base in names, f"{metric} is charted but not exported"
    charted = {next((m[: -len(s)] for s in SUFFIXES if m.endswith(s)), m) for m in used}
    musts = ("mcp2026_time_to_first_token_seconds", "mcp2026_gate_switches", "mcp2026_breaker_state")
    for must in (*musts, "mcp2026_engine_busy_seconds"):
        assert must in charted
    assert {p["gridPos"]["y"] for p in dashboard["panels"]}, "panels need positions"
