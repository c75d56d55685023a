"""A request as the scheduler sees it: token ids, how many of them have KV computed, and its status.

There are no prefill/decode phases: ``num_computed_tokens`` catches up to ``num_tokens``, whether the
missing tokens are a new prompt, the rest of a chunked prompt, or a recompute after preemption.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, with its blocks freed; recomputes prompt + outputs
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason ("stop" | "length" | "abort" | "error"), None while unfinished."""
        return self.value if self.is_finished else None

    @classmethod
    def finished(cls, reason: RequestStatus | str) -> RequestStatus:
        """The FINISHED_* status for a status or a reason string ("stop", "length", "abort", "error")."""
        status = reason if isinstance(reason, RequestStatus) else cls(reason)
        if not status.is_finished:
            raise ValueError(f"{reason!r} is not a finish reason; use stop, length, abort or error")
        return status


@dataclass(eq=False)
class Request:
    """Mutable per-request state, owned by the scheduler once added (compared by identity)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None  # opaque here; the engine reads max_tokens, stops, etc.
    priority: int = 0  # lower runs first under the "priority" policy
    arrival_time: float = field(default_factory=time.monotonic)
    ttft_deadline: float | None = None  # absolute, same clock as arrival_time ("deadline" policy)
    cache_salt: str | None = None  # per tenant: requests with different salts never share KV blocks
    tenant: str | None = None  # fair-share group: busy tenants' processed tokens follow their weights
    plan_id: str | None = None  # quantization plan: KV computed under another plan is not reused
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by prefix hits at first admission
    num_preemptions: int = 0
    error: str | None = None  # why it finished with FINISHED_ERROR
    arrival_index: int = 0  # set by the scheduler: breaks ties between equal arrival times

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of prompt + output ids."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole sequence (decode steps take one token)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def token_view(self) -> TokenView:
        """prompt + output ids as a sequence that copies only what is sliced (a decode step reads a few)."""
        return TokenView(self)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason


class TokenView(Sequence[int]):
    """A request's prompt + output ids, read in place: ``len`` and slices (step 1) and single ids."""

    def __init__(self, request: Request) -> None:
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("TokenView slices take step 1")
            return self._request.token_ids_slice(start, max(start, stop))
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"token {index} of {len(self)}")
        return self._request.token_ids_slice(position, position + 1)[0]
