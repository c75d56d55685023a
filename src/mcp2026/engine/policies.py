"""Scheduling policies: an order over requests. The smallest key is admitted first and preempted last."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from mcp2026.engine.request import Request


class SchedulingPolicy(ABC):
    """``key`` must be a total order (ties end with ``arrival_index``, unique per scheduler)."""

    # Whether a waiting request may preempt running ones that sort after it when blocks are short.
    preempts_for_waiting: ClassVar[bool] = False
    # Whether a prompt part-way through chunked prefill yields the step's budget to waiting prompts of its
    # tenant that sort before it (safe only with aging, which bounds how long it can be passed over).
    part_prefills_yield: ClassVar[bool] = False

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


class ShortestFirstPolicy(SchedulingPolicy):
    """Shortest prompt first, with aging: the key is a virtual start time, ``arrival_time + prompt tokens /
    aging_tokens_per_s``. In a burst (equal arrivals) short prompts go first, so most first tokens come after
    a fraction of the burst's prefill instead of after the prompts queued ahead of them; a long prompt is
    overtaken only by requests arriving less than ``(its length - theirs) / aging_tokens_per_s`` seconds after
    it, so it cannot starve. The key is fixed per request, so the order is total and stable across steps."""

    part_prefills_yield = True

    def __init__(self, aging_tokens_per_s: float) -> None:
        self.aging_tokens_per_s = aging_tokens_per_s

    def key(self, request: Request) -> tuple:
        start = request.arrival_time + request.num_prompt_tokens / self.aging_tokens_per_s
        return (start, request.arrival_index)


POLICIES: dict[str, Callable[[float], SchedulingPolicy]] = {
    "fcfs": lambda aging: FCFSPolicy(),
    "priority": lambda aging: PriorityPolicy(),
    "deadline": lambda aging: DeadlinePolicy(),
    "sjf": ShortestFirstPolicy,
}


def make_policy(name: str, aging_tokens_per_s: float = 1000.0) -> SchedulingPolicy:
    """``aging_tokens_per_s`` matters to ``sjf`` only: one second of waiting is worth this many prompt tokens."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(aging_tokens_per_s)
