"""Eviction policies for long contexts, applied per request at block granularity (a registry).

After each step, a request whose live blocks exceed its budget drops whole blocks: their table entries
become holes (``kv.manager.HOLE``) and the pool gets them back. Every other block keeps its table index, so
positions never shift (keys are cached after RoPE). Sinks (the first ``num_sink_tokens``) and the recent
window are never dropped. Policies: ``sink_window`` (StreamingLLM, arXiv:2309.17453), ``heavy_hitter``
(H2O, arXiv:2306.14048: recent attention mass per block, relative to uniform, decayed by age; the prompt's
blocks ranked by its last queries, as SnapKV), ``snap`` (SnapKV,
arXiv:2404.14469: once, after the prompt, from its last queries' attention), ``dynamic_window`` (our notes'
calcLeftBoundary: the left edge is the oldest block whose heat is >= ``heat_fraction`` x the recent mean).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from mcp2026.kv.manager import HOLE, KVCacheManager, cdiv


@dataclass(frozen=True)
class ScoringSpec:
    """Which attention the runner sums per block for a policy."""

    decode: bool = False  # every decode step's softmax
    observe_window: int = 0  # prefill: the attention of a chunk's last queries (0 = none)
    observe_every_chunk: bool = False  # every prefill chunk, or only the one reaching the last known token

    @property
    def is_needed(self) -> bool:
        return self.decode or self.observe_window > 0


@dataclass
class StepScores:
    """Attention mass per observation (one decode query, or a prefill window's mean) for one step."""

    request_ids: list[str]
    table_index: torch.Tensor  # (N, nb) long: the block's index in the request's table, -1 = padding
    mass: torch.Tensor  # (N, nb) float32


@dataclass(frozen=True)
class EvictionBudget:
    block_size: int
    num_sink_tokens: int
    recent_window: int  # tokens at the end that are never dropped
    sparsity_ratio: float | None  # fraction of the context dropped ...
    max_kv_tokens: int | None  # ... or a fixed number of tokens kept
    heat_fraction: float = 0.6
    observation_window: int = 32

    def num_sink_blocks(self) -> int:
        return cdiv(self.num_sink_tokens, self.block_size)

    def first_recent_block(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.recent_window) // self.block_size

    def num_protected(self, num_tokens: int) -> int:
        num_blocks = cdiv(num_tokens, self.block_size)
        first = self.first_recent_block(num_tokens)
        return num_blocks - first + min(self.num_sink_blocks(), first)

    def num_keep_blocks(self, num_tokens: int) -> int:
        if self.max_kv_tokens is not None:
            keep = min(self.max_kv_tokens, num_tokens)
        else:
            keep = num_tokens - int(num_tokens * (self.sparsity_ratio or 0.0))
        return max(cdiv(keep, self.block_size), self.num_protected(num_tokens))


@dataclass
class BlockView:
    """One request's blocks by table index: what a policy decides on."""

    num_tokens: int  # positions 0 .. num_tokens-1 hold KV
    is_live: torch.Tensor  # (nb,) bool
    is_sink: torch.Tensor  # (nb,) bool
    is_recent: torch.Tensor  # (nb,) bool
    score: torch.Tensor  # (nb,) float32 the policy's score (EvictionPolicy.score_kind; 0 = never observed)
    num_keep: int

    @property
    def candidates(self) -> torch.Tensor:
        return self.is_live & ~self.is_sink & ~self.is_recent

    @property
    def num_over(self) -> int:
        return int(self.is_live.sum()) - self.num_keep


@dataclass(frozen=True)
class StepEvent:
    num_live: int
    num_keep: int
    is_prompt_done: bool  # this step computed the request's last prompt token (first time)
    is_block_boundary: bool  # this step filled at least one block


def _lowest(view: BlockView, key: torch.Tensor, num: int) -> torch.Tensor:
    """Table indices of the ``num`` candidates with the lowest key (older first on ties)."""
    idx = view.candidates.nonzero().squeeze(1)
    if num <= 0 or idx.numel() == 0:
        return idx[:0]
    order = torch.sort(key[idx], stable=True).indices
    return idx[order[:num]]


class EvictionPolicy(ABC):
    """Decides which of one request's blocks to drop. Invariant: only ``view.candidates`` are returned."""

    name: str = ""
    scoring = ScoringSpec()

    # Whether it evicts while a prompt is still being prefilled (chunk by chunk), so a prompt longer than the
    # pool can stream through it; snap waits for the whole prompt.
    evicts_during_prefill: ClassVar[bool] = True
    # What BlockView.score holds: "mean" = mean attention mass per observation; "recent" = attention mass
    # relative to uniform (x live blocks observed), averaged with a per-token decay of half-life
    # ``score_half_life`` tokens, and in the step that completes the prompt, that step's observation alone.
    score_kind: ClassVar[str] = "mean"
    score_half_life: ClassVar[float] = 256.0

    def __init__(self, budget: EvictionBudget) -> None:
        self.budget = budget

    def num_keep_blocks(self, num_tokens: int, num_prompt_tokens: int) -> int:
        """Blocks to keep at ``num_tokens`` computed tokens (default: the budget at that length)."""
        return self.budget.num_keep_blocks(num_tokens)

    def triggers(self, event: StepEvent) -> bool:
        return event.num_live > event.num_keep

    @abstractmethod
    def select(self, view: BlockView) -> torch.Tensor: ...


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    POLICIES[cls.name] = cls
    return cls


@register_policy
class SinkWindow(EvictionPolicy):
    """Keep the sinks and the most recent blocks: drop the oldest."""

    name = "sink_window"

    def select(self, view: BlockView) -> torch.Tensor:
        return _lowest(view, torch.arange(view.is_live.numel(), dtype=torch.float32), view.num_over)


@register_policy
class HeavyHitter(EvictionPolicy):
    """Keep sinks, the recent blocks (as H2O: half the budget, at least the recent window) and the blocks
    with the highest recent attention mass (``score_kind = "recent"``).

    Scores: each observation's block mass is taken relative to uniform attention (x the live blocks it saw),
    so a block observed while the context was small is not inflated, and averaged with a decay by age in
    tokens, so stale early scores do not pin blocks forever. When the prompt completes, its blocks are ranked
    by the prompt's last queries alone (SnapKV's observation window: the question of a prompt decides what
    it needs). While a prompt is prefilled in chunks, only what exceeds the prompt's final budget is dropped:
    the peak stays the one the scheduler admits by (``KVEvictor.peak_blocks``) and the prompt's end decides
    the rest."""

    name = "heavy_hitter"
    score_kind = "recent"

    def __init__(self, budget: EvictionBudget) -> None:
        super().__init__(budget)
        self.scoring = ScoringSpec(True, budget.observation_window, observe_every_chunk=True)

    def num_keep_blocks(self, num_tokens: int, num_prompt_tokens: int) -> int:
        keep = self.budget.num_keep_blocks(num_tokens)
        if num_tokens < num_prompt_tokens:
            keep = max(keep, self.budget.num_keep_blocks(num_prompt_tokens))
        return keep

    def select(self, view: BlockView) -> torch.Tensor:
        live_recent = int((view.is_live & view.is_recent).sum())
        candidates = view.candidates.nonzero().squeeze(1)
        num_recent = min(max(0, view.num_keep // 2 - live_recent), candidates.numel())
        if num_recent:
            recent = view.is_recent.clone()
            recent[candidates[-num_recent:]] = True
            view = dataclasses.replace(view, is_recent=recent)
        return _lowest(view, view.score, view.num_over)


@register_policy
class Snap(EvictionPolicy):
    """Once, when the prompt is complete: keep the blocks its last queries attend to most."""

    name = "snap"

    def __init__(self, budget: EvictionBudget) -> None:
        super().__init__(budget)
        self.scoring = ScoringSpec(False, budget.observation_window, observe_every_chunk=False)

    evicts_during_prefill = False

    def triggers(self, event: StepEvent) -> bool:
        return event.is_prompt_done and event.num_live > event.num_keep

    def select(self, view: BlockView) -> torch.Tensor:
        return _lowest(view, view.score, view.num_over)


@register_policy
class DynamicWindow(EvictionPolicy):
    """calcLeftBoundary: drop every candidate older than the oldest one whose heat reaches
    ``heat_fraction`` x the recent window's mean heat; the budget caps what is left (oldest go first)."""

    name = "dynamic_window"

    def __init__(self, budget: EvictionBudget) -> None:
        super().__init__(budget)
        self.scoring = ScoringSpec(True, budget.observation_window, observe_every_chunk=True)

    def triggers(self, event: StepEvent) -> bool:
        return event.is_block_boundary or event.is_prompt_done or event.num_live > event.num_keep

    def select(self, view: BlockView) -> torch.Tensor:
        candidates = view.candidates
        recent = view.is_live & view.is_recent
        if not bool(candidates.any()) or not bool(recent.any()):
            return candidates.nonzero().squeeze(1)[:0]
        threshold = self.budget.heat_fraction * float(view.score[recent].mean())
        hot = (candidates & (view.score >= threshold)).nonzero().squeeze(1)
        left = int(hot[0]) if hot.numel() else view.is_live.numel()
        index = torch.arange(view.is_live.numel())
        dropped = candidates & (index < left)
        num_over = view.num_over - int(dropped.sum())
        if num_over > 0:
            rest = BlockView(
                view.num_tokens,
                view.is_live & ~dropped,
                view.is_sink,
                view.is_recent,
                view.score,
                view.num_keep,
            )
            dropped[_lowest(rest, index.float(), num_over)] = True
        return dropped.nonzero().squeeze(1)


def make_policy(name: str, budget: EvictionBudget) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; available: none, {', '.join(sorted(POLICIES))}")
    return POLICIES[name](budget)


# --- the runtime ----------------------------------------------------------------------------------------------
class Chunk(Protocol):
    request_id: str
    num_tokens: int


@dataclass
class _RequestState:
    row: int  # row in the score tensors
    num_evicted: int = 0  # holes in the table
    is_prompt_done: bool = False


@dataclass
class EvictionCounters:
    num_evicted_blocks: int = 0
    num_eviction_events: int = 0
    num_decisions: int = 0
    decide_ms: float = 0.0  # host time deciding and freeing
    score_ms: float = 0.0  # host time folding step scores into the per-request tensors


class KVEvictor:
    """Applies a policy to every request of a step, after the step. Owns per-request attention scores:
    (rows, max blocks per sequence) sums and observation counts, one row per request that has run; for
    ``score_kind == "recent"`` also the decayed relative mass and the last observation."""

    def __init__(self, policy: EvictionPolicy, manager: KVCacheManager, max_model_len: int) -> None:
        self.policy = policy
        self.budget = policy.budget
        self.manager = manager
        self.max_blocks = cdiv(max_model_len, self.budget.block_size)
        self.mass = torch.zeros(0, self.max_blocks)
        self.count = torch.zeros(0, self.max_blocks)
        self.recent = torch.zeros(0, self.max_blocks)  # decayed mass relative to uniform ("recent" scores)
        self.last = torch.zeros(0, self.max_blocks)  # the last observation, relative to uniform
        self._states: dict[str, _RequestState] = {}
        self._free_rows: list[int] = []
        self.counters = EvictionCounters()

    @property
    def scoring(self) -> ScoringSpec:
        return self.policy.scoring

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` holds at once when prefilled in chunks of at most
        ``chunk_tokens``: all of them, unless the policy evicts during prefill; then the blocks it keeps plus
        one chunk's (and the partly filled block the chunk starts in)."""
        bs = self.budget.block_size
        full = cdiv(num_tokens, bs)
        if not self.policy.evicts_during_prefill:
            return full
        return min(full, self.budget.num_keep_blocks(num_tokens) + cdiv(chunk_tokens, bs) + 1)

    def _state(self, request_id: str) -> _RequestState:
        state = self._states.get(request_id)
        if state is None:
            if not self._free_rows:
                old = self.mass.shape[0]
                new = max(8, 2 * old)
                grow = torch.zeros(new - old, self.max_blocks)
                self.mass, self.count = torch.cat([self.mass, grow]), torch.cat([self.count, grow])
                self.recent, self.last = torch.cat([self.recent, grow]), torch.cat([self.last, grow])
                self._free_rows = list(range(new - 1, old - 1, -1))
            state = self._states[request_id] = _RequestState(self._free_rows.pop())
        return state

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests finished or were preempted (a recompute starts from a full context again)."""
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is not None:
                for t in (self.mass, self.count, self.recent, self.last):
                    t[state.row].zero_()
                self._free_rows.append(state.row)

    def absorb(self, scores: Iterable[StepScores], num_new_tokens: dict[str, int] | None = None) -> None:
        """Fold a step's observations in. ``num_new_tokens``: tokens each request computed in the step (the
        age, for the decay of "recent" scores; 1 when not given)."""
        t0 = time.perf_counter()
        recent = self.policy.score_kind == "recent"
        for part in scores:
            rows = torch.tensor([self._state(rid).row for rid in part.request_ids], dtype=torch.long)
            valid = part.table_index >= 0
            index = (rows.unsqueeze(1).expand_as(part.table_index)[valid], part.table_index[valid])
            mass = part.mass.float()
            if recent:
                # relative to uniform: x the live blocks each observation saw
                rel = (mass * valid.sum(1, keepdim=True)).masked_fill(~valid, 0.0)
                age = torch.tensor([float((num_new_tokens or {}).get(r, 1)) for r in part.request_ids])
                keep = (0.5 ** (age / self.policy.score_half_life)).unsqueeze(1).expand_as(rel)[valid]
                seen = self.count[index] > 0  # a block's first observation is its score
                old = self.recent[index]
                self.recent[index] = torch.where(seen, keep * old + (1.0 - keep) * rel[valid], rel[valid])
                self.last[rows] = 0.0
                self.last.index_put_(index, rel[valid])
            self.mass.index_put_(index, mass[valid], accumulate=True)
            self.count.index_put_(index, torch.ones(index[0].shape), accumulate=True)
        self.counters.score_ms += (time.perf_counter() - t0) * 1e3

    def after_step(
        self, chunks: Iterable[Chunk], scores: Iterable[StepScores], get_request: Callable[[str], Any]
    ) -> int:
        """Fold the step's scores in, then evict for every request that ran. Returns blocks evicted."""
        chunks = list(chunks)
        self.absorb(scores, {c.request_id: c.num_tokens for c in chunks})
        t0 = time.perf_counter()
        num_evicted = 0
        bs = self.budget.block_size
        for chunk in chunks:
            request = get_request(chunk.request_id)
            if request is None or request.is_finished or request.num_computed_tokens == 0:
                continue
            state = self._state(chunk.request_id)
            n = request.num_computed_tokens
            is_prompt_done = not state.is_prompt_done and n >= request.num_prompt_tokens
            state.is_prompt_done = state.is_prompt_done or is_prompt_done
            event = StepEvent(
                num_live=cdiv(n, bs) - state.num_evicted,
                num_keep=self.policy.num_keep_blocks(n, request.num_prompt_tokens),
                is_prompt_done=is_prompt_done,
                is_block_boundary=(n // bs) != (n - chunk.num_tokens) // bs,
            )
            if self.policy.triggers(event):
                num_evicted += self._evict(chunk.request_id, state, n, event.num_keep, is_prompt_done)
        self.counters.decide_ms += (time.perf_counter() - t0) * 1e3
        return num_evicted

    def score(self, row: int, num_blocks: int, is_prompt_done: bool = False) -> torch.Tensor:
        """(num_blocks,) the policy's score of one request's blocks (``EvictionPolicy.score_kind``)."""
        if self.policy.score_kind == "recent":
            return (self.last if is_prompt_done else self.recent)[row, :num_blocks].clone()
        return self.mass[row, :num_blocks] / self.count[row, :num_blocks].clamp_min(1.0)

    def _evict(
        self,
        request_id: str,
        state: _RequestState,
        num_tokens: int,
        num_keep: int,
        is_prompt_done: bool = False,
    ) -> int:
        self.counters.num_decisions += 1
        num_blocks = cdiv(num_tokens, self.budget.block_size)
        table = self.manager.block_table(request_id)[:num_blocks]
        index = torch.arange(num_blocks)
        view = BlockView(
            num_tokens=num_tokens,
            is_live=torch.tensor([b != HOLE for b in table], dtype=torch.bool),
            is_sink=index < self.budget.num_sink_blocks(),
            is_recent=index >= self.budget.first_recent_block(num_tokens),
            score=self.score(state.row, num_blocks, is_prompt_done),
            num_keep=num_keep,
        )
        chosen = self.policy.select(view)
        if chosen.numel() == 0:
            return 0
        assert bool(view.candidates[chosen].all()), f"policy {self.policy.name} chose a protected block"
        freed = self.manager.evict_blocks(request_id, chosen.tolist())
        state.num_evicted += len(freed)
        self.counters.num_evicted_blocks += len(freed)
        self.counters.num_eviction_events += 1
        return len(freed)

    def report(self) -> dict:
        c = self.counters
        return {
            "policy": self.policy.name,
            "num_evicted_blocks": c.num_evicted_blocks,
            "num_eviction_events": c.num_eviction_events,
            "num_decisions": c.num_decisions,
            "decide_ms": c.decide_ms,
            "score_ms": c.score_ms,
            "num_tracked_requests": len(self._states),
        }
