"""Scheduling policies: an order over requests. The smallest key is admitted first and preempted last."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from mcp2026.engine.request import Request


class SchedulingPolicy(ABC):
    """``key`` must be a total order (ties end with ``arrival_index``, unique per scheduler)."""

    # Whether a waiting request may preempt running ones that sort after it when blocks are short.
    preempts_for_waiting: ClassVar[bool] = False

    @abstractmethod
    def key(self, request: Request) -> tuple: ...


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order."""

    def key(self, request: Request) -> tuple:
        return (request.arrival_time, request.arrival_index)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, then arrival; a more urgent arrival may preempt less urgent running work."""

    preempts_for_waiting = True

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time, request.arrival_index)


class DeadlinePolicy(SchedulingPolicy):
    """Earliest TTFT deadline first; requests without a deadline after all others, by arrival."""

    def key(self, request: Request) -> tuple:
        deadline = request.ttft_deadline
        return (deadline is None, deadline or 0.0, request.arrival_time, request.arrival_index)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "deadline": DeadlinePolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {sorted(POLICIES)}") from None
