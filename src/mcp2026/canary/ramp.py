"""The live canary's traffic ramp: the candidate's share of tenants moved by the gate's verdicts.

PROMOTE moves the share one step up the configured ramp (its last step, 1.0, is "promoted": the candidate
serves everyone); ROLLBACK sets it to 0 at once and ends the ramp; HOLD keeps it. Without a ramp the share
stays fixed and verdicts are only observed. Pure state: the caller decides when a verdict is due and
supplies the time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mcp2026.canary.gate import HOLD, PROMOTE, ROLLBACK, SAFE, TRIP, VERDICT_HOLD, VERDICTS, GateResult

OBSERVING, RAMPING, PROMOTED, ROLLED_BACK = "observing", "ramping", "promoted", "rolled_back"
STATES = (OBSERVING, RAMPING, PROMOTED, ROLLED_BACK)
SHIFT_DECISIONS = (PROMOTE, ROLLBACK)


@dataclass(frozen=True)
class Shift:
    """One change of the candidate's share and the verdict that made it."""

    at_s: float  # on the caller's clock
    from_share: float
    to_share: float
    verdict: str  # PROMOTE | ROLLBACK
    reason: str  # the metrics that decided

    def describe(self) -> str:
        return f"candidate share {self.from_share:g} -> {self.to_share:g} ({self.verdict}: {self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def deciding_reason(result: GateResult) -> str:
    """The metrics behind a verdict: the tripped ones for ROLLBACK, the held ones for HOLD, all for PROMOTE."""
    status = {ROLLBACK: TRIP, VERDICT_HOLD: HOLD, PROMOTE: SAFE}[result.verdict]
    parts = [f"{d.measurement.name} {d.reason}" for d in result.decisions if d.status == status]
    prefix = "every metric safe: " if result.verdict == PROMOTE else ""
    return prefix + ("; ".join(parts) or "no metric measured")


class TrafficRamp:
    """The candidate's current share and where it stands on the ramp. Invariants: the share only rises
    (one step per PROMOTE) until a rollback sets it to 0; after PROMOTED or ROLLED_BACK no verdict moves it,
    and only ``roll_back`` (a dead candidate) still can, from PROMOTED."""

    def __init__(self, steps: Sequence[float], fixed_share: float) -> None:
        """``steps``: the ramp (first = starting share, last = 1.0), or empty to observe at ``fixed_share``."""
        self.steps = tuple(steps)
        self.state = RAMPING if self.steps else OBSERVING
        self.share = self.steps[0] if self.steps else fixed_share
        self._step = 0
        self.shifts: list[Shift] = []
        self.num_evaluations = dict.fromkeys(VERDICTS, 0)

    @property
    def is_evaluating(self) -> bool:
        """Verdicts may still move the share."""
        return self.state == RAMPING

    @property
    def can_roll_back(self) -> bool:
        return self.state in (RAMPING, PROMOTED)

    def apply(self, result: GateResult, now_s: float) -> Shift | None:
        """Act on one verdict; the shift it made, if any."""
        if not self.is_evaluating:
            raise RuntimeError(f"the ramp is {self.state}: no verdict moves the share any more")
        self.num_evaluations[result.verdict] += 1
        if result.verdict == ROLLBACK:
            return self.roll_back(deciding_reason(result), now_s)
        if result.verdict != PROMOTE:
            return None
        self._step += 1
        to_share = self.steps[self._step]
        if self._step == len(self.steps) - 1:
            self.state = PROMOTED
        return self._shift(to_share, PROMOTE, deciding_reason(result), now_s)

    def roll_back(self, reason: str, now_s: float) -> Shift | None:
        """Everything to the baseline at once; None when the ramp is not live (observing, rolled back)."""
        if not self.can_roll_back:
            return None
        self.state = ROLLED_BACK
        return self._shift(0.0, ROLLBACK, reason, now_s)

    def _shift(self, to_share: float, verdict: str, reason: str, now_s: float) -> Shift:
        shift = Shift(now_s, self.share, to_share, verdict, reason)
        self.share = to_share
        self.shifts.append(shift)
        return shift

    def num_shifts(self, verdict: str) -> int:
        return sum(s.verdict == verdict for s in self.shifts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "share": self.share,
            "steps": list(self.steps),
            "evaluations": dict(self.num_evaluations),
            "shifts": [s.to_dict() for s in self.shifts],
        }
