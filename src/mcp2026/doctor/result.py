"""What one doctor check returns, and how a list of checks runs (an unexpected exception is a FAIL)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"  # works, but something is likely to hurt (exit code stays 0)
    FAIL = "FAIL"  # will not work as configured (exit code 1)
    SKIP = "SKIP"  # not run: not configured, not applicable, or a measurement skipped by --quick


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    reason: str
    fix: str = ""  # what to do; empty on PASS and SKIP
    details: Mapping[str, Any] = field(default_factory=dict)  # JSON-able figures behind the reason
    section: str = ""  # filled in by run_checks

    def __post_init__(self) -> None:
        if self.status in (Status.PASS, Status.SKIP) and self.fix:
            raise ValueError(f"check {self.name}: a {self.status.value} result has no fix")
        if self.status in (Status.WARN, Status.FAIL) and not self.fix:
            raise ValueError(f"check {self.name}: a {self.status.value} result needs a fix")


def passed(name: str, reason: str, **details: Any) -> CheckResult:
    return CheckResult(name, Status.PASS, reason, details=details)


def warned(name: str, reason: str, fix: str, **details: Any) -> CheckResult:
    return CheckResult(name, Status.WARN, reason, fix, details)


def failed(name: str, reason: str, fix: str, **details: Any) -> CheckResult:
    return CheckResult(name, Status.FAIL, reason, fix, details)


def skipped(name: str, reason: str, **details: Any) -> CheckResult:
    return CheckResult(name, Status.SKIP, reason, details=details)


@dataclass(frozen=True)
class Check:
    """One named check of a section; ``run(context)`` returns one result or several (e.g. one per file)."""

    section: str
    name: str
    run: Callable[[Any], CheckResult | Sequence[CheckResult]]


def run_check(check: Check, context: Any) -> list[CheckResult]:
    try:
        out = check.run(context)
    except Exception as e:  # a check must never end the report with a traceback
        out = failed(
            check.name,
            f"the check raised {type(e).__name__}: {e}",
            "fix what the message names; if the input looks right, report it as a doctor bug",
        )
    results = [out] if isinstance(out, CheckResult) else list(out)
    return [replace(r, section=check.section) for r in results]


def run_checks(checks: Sequence[Check], context: Any) -> list[CheckResult]:
    return [r for check in checks for r in run_check(check, context)]


def summarize(results: Sequence[CheckResult]) -> dict[str, int]:
    counts = {s.value.lower(): 0 for s in Status}
    for r in results:
        counts[r.status.value.lower()] += 1
    return counts
