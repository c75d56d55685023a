"""Weighted fair sharing of processed tokens across tenants: start-time fair queuing (Goyal et al., SFQ)
over virtual token counters. While two tenants both have backlog, their processed tokens follow their weights.

Each tenant has a virtual finish tag (tokens processed / weight). Work is ordered by start tag: a tenant's
k-th unit this step starts where its previous one finished. A tenant that becomes busy again starts at the
virtual time (the lowest tag among busy tenants), so idle time banks no credit. Inside one tenant the
engine's scheduling policy keeps its order. Pure Python, owned by the Scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mcp2026.engine.request import Request

Tenant = str | None  # None: the one default tenant


class FairShare:
    """Virtual token counters per tenant. Invariant: a busy tenant's tag is never below ``virtual_time``
    when it becomes busy; ``virtual_time`` never decreases."""

    def __init__(self) -> None:
        self.weights: dict[Tenant, float] = {}
        self.num_processed: dict[Tenant, int] = {}  # tokens computed per tenant (prefill + decode)
        self.virtual_time = 0.0
        self._tags: dict[Tenant, float] = {}  # virtual finish tag of each tenant's last charged work
        self._num_requests: dict[Tenant, int] = {}  # unfinished requests of busy tenants

    def set_weight(self, tenant: Tenant, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"tenant {tenant!r}: the fair-share weight must be > 0, got {weight}")
        self.weights[tenant] = float(weight)

    def weight(self, tenant: Tenant) -> float:
        return self.weights.get(tenant, 1.0)

    def tag(self, tenant: Tenant) -> float:
        return self._tags.get(tenant, self.virtual_time)

    # ---- backlog ----------------------------------------------------------------------------------
    def add(self, tenant: Tenant) -> None:
        """A request of ``tenant`` arrived (unfinished until ``remove``)."""
        num = self._num_requests.get(tenant, 0)
        if num == 0:
            self._tags[tenant] = max(self._tags.get(tenant, 0.0), self.virtual_time)
        self._num_requests[tenant] = num + 1

    def remove(self, tenant: Tenant) -> None:
        num = self._num_requests.get(tenant, 0) - 1
        if num > 0:
            self._num_requests[tenant] = num
        else:
            self._num_requests.pop(tenant, None)

    # ---- ordering and charging --------------------------------------------------------------------
    def order(
        self,
        requests: Iterable[Request],
        key: Callable[[Request], Any],
        cost: Callable[[Request], int],
        charged: Mapping[Tenant, int] | None = None,
        group: Callable[[Request], Any] = lambda r: 0,
    ) -> list[Request]:
        """``requests`` merged across tenants by (``group``, start tag); each tenant's own requests keep
        ``key`` order, which must sort by ``group`` first. ``cost``: tokens a request would take;
        ``charged``: tokens each tenant already got this step. One tenant: exactly ``sorted(requests, key=key)``."""
        by_tenant: dict[Tenant, list[Request]] = {}
        for r in requests:
            by_tenant.setdefault(r.tenant, []).append(r)
        if len(by_tenant) <= 1:
            return sorted((r for queue in by_tenant.values() for r in queue), key=key)
        charged = charged or {}
        tagged: list[tuple[Any, float, Any, Request]] = []
        for tenant, queue in by_tenant.items():
            weight = self.weight(tenant)
            start = self.tag(tenant) + charged.get(tenant, 0) / weight
            for r in sorted(queue, key=key):
                tagged.append((group(r), start, key(r), r))
                start += max(1, cost(r)) / weight
        tagged.sort(key=lambda t: t[:3])
        return [t[3] for t in tagged]

    def charge(self, tokens: Mapping[Tenant, int]) -> None:
        """Tokens computed this step per tenant; then advance the virtual time to the busy tenants' lowest tag."""
        for tenant, num in tokens.items():
            if num:
                self._tags[tenant] = self.tag(tenant) + num / self.weight(tenant)
                self.num_processed[tenant] = self.num_processed.get(tenant, 0) + num
        busy = [self._tags.get(t, self.virtual_time) for t in self._num_requests]
        if busy:
            self.virtual_time = max(self.virtual_time, min(busy))
