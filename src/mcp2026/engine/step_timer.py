"""Where a step's time goes: wall time per phase, accumulated into ``StepStats`` (the profile of
``Pipeline.infer`` and the server's metrics read them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mcp2026.engine.output import SchedulerOutput


@dataclass
class StepStats:
    """Wall time per phase, accumulated (ms); the profile of ``Pipeline.infer`` reads these."""

    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    sample_ms: float = 0.0
    detokenize_ms: float = 0.0
    num_steps: int = 0
    num_decode_steps: int = 0
    # tokens decode steps produced (with speculative decoding, more than steps x batch)
    num_decode_tokens: int = 0
    peak_kv_usage: float = 0.0
    decode_context_tokens: int = 0  # sum over decode steps of tokens attended (KV bytes read)
    kv_bytes_released: int = 0  # returned to the OS by DTSS shard releases
    num_window_released_blocks: int = 0  # KV blocks behind every layer's sliding window, back in the pool
    # speculative decoding: drafts verified, tokens drafted, drafted tokens the sampler kept
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def speculation(self) -> dict[str, float | int | None]:
        """The draft counters with the acceptance rate and the tokens a drafted step yields on average."""
        drafted, accepted = self.num_draft_tokens, self.num_accepted_tokens
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "tokens_per_draft": 1 + accepted / self.num_drafts if self.num_drafts else None,
        }

    def reset(self) -> None:
        self.__init__()


class StepTimer:
    """Times the phases of a step into ``stats``; a step that prefills also reports its tokens and seconds to
    ``on_prefill`` (the scheduler's estimate of prefill speed), a decode step (drafts included) to
    ``on_decode`` (the drafter's step costs). A phase that raises is not counted."""

    def __init__(
        self,
        stats: StepStats,
        on_prefill: Callable[[int, float], None],
        on_decode: Callable[[int, float], None] | None = None,
    ) -> None:
        self.stats = stats
        self.on_prefill = on_prefill
        self.on_decode = on_decode

    @contextmanager
    def execute(self, out: SchedulerOutput) -> Iterator[None]:
        """The model's forward over ``out``: prefill time if any chunk prefills, else decode time."""
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        stats = self.stats
        prefill = [c.num_tokens for c in out.chunks if not c.is_decode]
        if prefill:
            stats.prefill_ms += seconds * 1e3
            self.on_prefill(sum(prefill), seconds)
        else:
            stats.decode_ms += seconds * 1e3
            stats.num_decode_steps += 1
            stats.num_decode_tokens += len(out.chunks)  # the engine adds the draft tokens it keeps
            # tokens each decode read (evicted KV is not read)
            stats.decode_context_tokens += sum(c.kv_start + 1 for c in out.chunks)
            if self.on_decode is not None:
                self.on_decode(out.num_batched_tokens, seconds)
        stats.num_steps += 1

    @contextmanager
    def phase(self, field: str) -> Iterator[None]:
        """Add the block's wall time to ``stats.<field>`` (``sample_ms``, ``detokenize_ms``)."""
        t0 = time.perf_counter()
        yield
        setattr(self.stats, field, getattr(self.stats, field) + (time.perf_counter() - t0) * 1e3)
