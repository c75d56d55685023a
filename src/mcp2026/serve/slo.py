"""SLO circuit breaker: when too many recent requests failed or missed their TTFT/TPOT SLO, shed load.

Outcomes go into a sliding window of time buckets (default 5 min in 30 buckets). Closed: everything is
admitted; when at least ``min_requests`` outcomes are in the window and the bad share passes ``threshold``
(default 5%), the breaker opens. Open: requests below ``bypass_priority`` (more urgent tenants) still
enter, others get 429 with Retry-After, for ``open_s``. Half-open: up to ``num_probes`` requests probe at a
time; ``num_probes`` good outcomes close it (and clear the window), one bad outcome opens it again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass(frozen=True)
class BreakerConfig:
    enabled: bool = True
    window_s: float = 300.0
    num_buckets: int = 30
    threshold: float = 0.05  # bad share of outcomes in the window that opens the breaker
    min_requests: int = 20  # fewer outcomes than this never open it
    open_s: float = 30.0  # time open before probing
    num_probes: int = 3
    bypass_priority: int = 0  # tenants with priority < this are admitted even when open

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.open_s > 0):
            raise ValueError("BreakerConfig.window_s and open_s must be > 0")
        if self.num_buckets < 1 or self.min_requests < 1 or self.num_probes < 1:
            raise ValueError("BreakerConfig.num_buckets, min_requests and num_probes must be >= 1")
        if not 0 < self.threshold < 1:
            raise ValueError(f"BreakerConfig.threshold must be in (0, 1), got {self.threshold}")


class BreakerOpen(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(
            f"the server is shedding load (SLO circuit breaker open); retry in {retry_after_s:.0f} s"
        )
        self.retry_after_s = retry_after_s


class CircuitBreaker:
    """Thread-safe. ``admit`` before work (returns whether the request is a half-open probe), ``record``
    each outcome after it. ``on_change(state)`` is called on every transition."""

    def __init__(
        self,
        config: BreakerConfig | None = None,
        on_change: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or BreakerConfig()
        self.on_change = on_change
        self.clock = clock
        self.state = CLOSED
        self.num_trips = 0
        self._buckets: deque[list[float]] = deque()  # [start time, outcomes, bad outcomes]
        self._opened_at = 0.0
        self._num_probes_in_flight = 0
        self._num_good_probes = 0
        self._lock = threading.RLock()  # on_change may read bad_share()

    def admit(self, priority: int) -> bool:
        """Raise BreakerOpen if this request must be shed; True if it is admitted as a probe."""
        if not self.config.enabled or priority < self.config.bypass_priority:
            return False
        with self._lock:
            now = self.clock()
            if self.state == OPEN:
                waited = now - self._opened_at
                if waited < self.config.open_s:
                    raise BreakerOpen(self.config.open_s - waited)
                self._set(HALF_OPEN)
                self._num_probes_in_flight = self._num_good_probes = 0
            if self.state == HALF_OPEN:
                if self._num_probes_in_flight >= self.config.num_probes:
                    raise BreakerOpen(1.0)
                self._num_probes_in_flight += 1
                return True
            return False

    def record(self, is_bad: bool, is_probe: bool = False) -> None:
        if not self.config.enabled:
            return
        with self._lock:
            now = self.clock()
            if is_probe and self.state == HALF_OPEN:
                self._num_probes_in_flight -= 1
                if is_bad:
                    self._trip(now)
                    return
                self._num_good_probes += 1
                if self._num_good_probes >= self.config.num_probes:
                    self._buckets.clear()
                    self._set(CLOSED)
                return
            self._add(now, is_bad)
            if self.state == CLOSED and self._is_over_threshold():
                self._trip(now)

    def cancel_probe(self) -> None:
        """A probe ended without an outcome (the client left): free its slot, count nothing."""
        with self._lock:
            if self.state == HALF_OPEN and self._num_probes_in_flight > 0:
                self._num_probes_in_flight -= 1

    def bad_share(self) -> float:
        with self._lock:
            self._expire(self.clock())
            total = sum(b[1] for b in self._buckets)
            return sum(b[2] for b in self._buckets) / total if total else 0.0

    def _add(self, now: float, is_bad: bool) -> None:
        self._expire(now)
        width = self.config.window_s / self.config.num_buckets
        if not self._buckets or now - self._buckets[-1][0] >= width:
            self._buckets.append([now, 0, 0])
        bucket = self._buckets[-1]
        bucket[1] += 1
        bucket[2] += int(is_bad)

    def _expire(self, now: float) -> None:
        while self._buckets and now - self._buckets[0][0] > self.config.window_s:
            self._buckets.popleft()

    def _is_over_threshold(self) -> bool:
        total = sum(b[1] for b in self._buckets)
        bad = sum(b[2] for b in self._buckets)
        return total >= self.config.min_requests and bad / total > self.config.threshold

    def _trip(self, now: float) -> None:
        self._opened_at = now
        self.num_trips += 1
        self._set(OPEN)

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            if self.on_change is not None:
                self.on_change(state)
