"""The doctor's output: a rich table (section, check, status, reason, fix) and a summary line, or JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

from rich.table import Table

from mcp2026.doctor.result import CheckResult, Status, summarize

JSON_SCHEMA_VERSION = 1
STATUS_STYLES = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}


def exit_code(results: Sequence[CheckResult]) -> int:
    """1 when any check failed; warnings and skips do not fail the run."""
    return int(any(r.status is Status.FAIL for r in results))


def summary_line(results: Sequence[CheckResult], elapsed_s: float) -> str:
    counts = summarize(results)
    verdict = "FAIL" if exit_code(results) else "OK"
    return (
        f"{verdict}: {counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed, "
        f"{counts['skip']} skipped in {elapsed_s:.1f} s"
    )


def to_table(results: Sequence[CheckResult]) -> Table:
    table = Table(title="mcp2026 doctor", show_lines=False)
    for column in ("section", "check", "status", "reason", "fix"):
        table.add_column(column, overflow="fold")
    previous = None
    for r in results:
        style = STATUS_STYLES[r.status]
        table.add_row(
            r.section if r.section != previous else "",
            r.name,
            f"[{style}]{r.status.value}[/]",
            r.reason,
            r.fix,
        )
        previous = r.section
    return table


def to_json(results: Sequence[CheckResult], elapsed_s: float) -> str:
    document = {
        "schema_version": JSON_SCHEMA_VERSION,
        "results": [{**asdict(r), "status": r.status.value} for r in results],
        "summary": {**summarize(results), "ok": not exit_code(results), "elapsed_s": round(elapsed_s, 3)},
    }
    return json.dumps(document, indent=1, default=str)
