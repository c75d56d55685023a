"""Eviction policies for long contexts, per layer and KV head, at block granularity (a registry).

After each step, a request whose blocks exceed its budget drops blocks, chosen separately in every *lane*
(one layer's one KV head: heads attend to different tokens, so each keeps its own heavy hitters, as H2O and
SnapKV do). Every lane drops the same number of blocks, and what each keeps is compacted, in order, into
the request's first slots (``PagedKVCache.compact``): the table then ends in slots nobody needs, which go
back to the pool (``KVCacheManager.drop_slots``). Keys are cached after RoPE, so a block read from another
slot keeps its position; which block a slot holds in each lane is tracked by ``kv.lane_scores`` (``origin``).
Sinks (the first ``num_sink_tokens``) and the recent window are never dropped, so they sit in the same slots
in every lane. This module holds the policies and what they decide on; ``kv.evictor`` runs them after a step.
Policies: ``sink_window`` (StreamingLLM, arXiv:2309.17453), ``heavy_hitter`` (H2O, arXiv:2306.14048: recent
attention mass per block, relative to uniform, decayed by age; the prompt's blocks ranked by its last
queries, as SnapKV), ``snap`` (SnapKV, arXiv:2404.14469: once, after the prompt, from its last queries'
attention), ``dynamic_window`` (calcLeftBoundary: the left edge is the oldest block whose heat
is >= ``heat_fraction`` x the recent mean). ``heavy_hitter`` and ``snap`` also keep, in every lane, the passage
the prompt's question shares the most rare tokens with (``lexical_anchors``).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from mcp2026.kv.manager import cdiv


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
    num_slots: list[int]  # slots each request's observation covered (its first ones, in table order)
    mass: torch.Tensor  # (N, lanes, nb) float32, nb >= max(num_slots); lane = layer * num_kv_heads + head


@dataclass(frozen=True)
class EvictionBudget:
    block_size: int
    num_sink_tokens: int
    recent_window: int  # tokens at the end that are never dropped
    sparsity_ratio: float | None  # fraction of the context dropped ...
    max_kv_tokens: int | None  # ... or a fixed number of tokens kept
    heat_fraction: float = 0.6
    observation_window: int = 32
    max_heavy_share: float = 0.9  # heavy_hitter: the most of a lane's budget that goes to heavy hitters
    # heavy_hitter / snap: passages the question names, kept in every lane (lexical_anchors) for the first
    # anchor_tokens tokens after the prompt; then the answer's own attention decides
    num_anchors: int = 1
    anchor_tokens: int = 32
    # heavy_hitter / snap: greedy draft tokens whose attention, over the whole prompt, joins the question's in
    # ranking the prompt's blocks (engine.lookahead; the drafts are rolled back), and that observation's weight
    lookahead_tokens: int = 0
    lookahead_weight: float = 0.5

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
    """One request's slots in every lane: what a policy decides on. Slots hold blocks in increasing
    position order in each lane; sinks are the first slots and the recent window the last, in every lane."""

    num_tokens: int  # positions 0 .. num_tokens-1 have been computed
    origin: torch.Tensor  # (lanes, n) long: the block (positions // block_size) each slot holds
    is_sink: torch.Tensor  # (lanes, n) bool
    is_recent: torch.Tensor  # (lanes, n) bool
    score: torch.Tensor  # (lanes, n) float32: the policy's score (see EvictionPolicy.score_kind)
    num_keep: int
    is_prompt_end: bool = False  # the step that completed the prompt
    is_anchor: torch.Tensor | None = None  # (lanes, n) bool: lexical anchors, kept in every lane
    num_over_budget: int = 0  # of num_keep, slots held on top of the budget (live anchors)

    @property
    def candidates(self) -> torch.Tensor:
        protected = self.is_sink | self.is_recent
        return ~(protected if self.is_anchor is None else protected | self.is_anchor)

    @property
    def num_flexible(self) -> int:
        """Slots of the budget past the protected ones (sinks, recent window, anchors): the same in every lane."""
        return self.num_keep - (self.origin.shape[1] - self.num_candidates)

    @property
    def num_over(self) -> int:
        return self.origin.shape[1] - self.num_keep

    @property
    def num_candidates(self) -> int:
        """Candidates per lane (the same in every lane)."""
        return int(self.candidates[0].sum()) if self.origin.numel() else 0


@dataclass(frozen=True)
class StepEvent:
    num_live: int  # slots holding KV
    num_keep: int
    is_prompt_done: bool  # this step computed the request's last prompt token (first time)
    is_block_boundary: bool  # this step filled at least one block
    num_over_budget: int = 0  # of num_keep, blocks held on top of the budget (live anchors)


def _lowest(view: BlockView, key: torch.Tensor, num: int) -> torch.Tensor:
    """(lanes, n) bool: in every lane, the ``num`` candidates with the lowest key (older first on ties)."""
    num = min(max(num, 0), view.num_candidates)
    chosen = torch.zeros_like(view.candidates)
    if num:
        masked = key.float().nan_to_num(0.0).masked_fill(~view.candidates, float("inf"))
        order = torch.sort(masked, dim=1, stable=True).indices[:, :num]  # slot order == age order
        chosen.scatter_(1, order, True)
    return chosen


# Just below 1: a successor ranks right after the block it follows, so when only one of the two fits, the
# block that was attended to stays (ties drop the older first).
SUCCESSOR_CREDIT = 0.999


def _with_successors(view: BlockView, score: torch.Tensor) -> torch.Tensor:
    """Each slot's score raised to its predecessor's when the two hold consecutive blocks: what a block
    boundary cuts in two stays together. A fact the question attends to ("the code for Elena is 61750.")
    often ends in the next block, which the question itself does not attend to; without this, the
    retrieval check's answers lost their last digits (SnapKV pools its scores over neighbouring tokens for
    the same reason). Block-level and forward only (docs/kv-cache.md, "Successors")."""
    score = score.float().nan_to_num(0.0)
    follows = torch.zeros_like(view.candidates)
    consecutive = view.origin[:, 1:] == view.origin[:, :-1] + 1
    follows[:, 1:] = consecutive & ~view.is_sink[:, :-1]  # a sink's successor is no fact's end
    previous = torch.zeros_like(score)
    previous[:, 1:] = score[:, :-1]
    return torch.where(follows, torch.maximum(score, SUCCESSOR_CREDIT * previous), score)


def lexical_anchors(
    prompt_ids: Sequence[int], block_size: int, window: int, num: int, first_block: int = 0
) -> list[tuple[int, ...]]:
    """The ``num`` passages that share the most rare tokens with the prompt's last ``window`` tokens (its
    question), best first, each a block and the block after it (where a stated fact ends; the last block
    alone): BM25's idea, with token weights log(blocks / blocks holding the token) over the prompt. Empty
    when nothing before the question shares a token with it that is not in every block. Blocks before
    ``first_block`` (the sinks, kept anyway, and a chat template's start, which shares its markers with the
    question's end) are not candidates.

    Why: at 2k-token prompts the question's attention does not mark the passage the answer copies from in the
    lanes that copy it (docs/kv-cache.md, "Retrieval at 2k, and lexical anchors"): the model finds "The secret
    code for Lena is 95463." while writing "... for Lena is", in lanes that gave that block 0.001x uniform
    attention while reading the question. The words the question shares with it do mark it."""
    n = len(prompt_ids)
    num_blocks = cdiv(n, block_size)
    first_question_block = max(0, n - window) // block_size
    blocks = [set(prompt_ids[b * block_size : (b + 1) * block_size]) for b in range(num_blocks)]
    blocks_holding = Counter(t for block in blocks for t in block)
    question = set(prompt_ids[max(0, n - window) :])
    scored = []
    for b in range(first_block, first_question_block):
        weight = sum(math.log(num_blocks / blocks_holding[t]) for t in blocks[b] & question)
        if weight > 0:
            scored.append((-weight, b))
    return [tuple(a for a in (b, b + 1) if a < num_blocks) for _, b in sorted(scored)[:num]]


class EvictionPolicy(ABC):
    """Decides which of one request's slots each lane drops: a (lanes, n) bool mask with the same number of
    candidates (only ``view.candidates``) in every lane."""

    name: str = ""
    scoring = ScoringSpec()

    # Whether it evicts while a prompt is still being prefilled (chunk by chunk), so a prompt longer than the
    # pool can stream through it; snap waits for the whole prompt.
    evicts_during_prefill: ClassVar[bool] = True
    # Whether it keeps a prompt whole until its last chunk when the pool could hold the whole prompt (and
    # streams it only when not): what the prompt's end attends to then decides over every prompt block.
    defers_prompt: ClassVar[bool] = False
    # What BlockView.score holds: "mean" = mean attention mass per observation; "recent" = attention mass
    # relative to uniform (x live blocks observed), averaged with a per-token decay of half-life
    # ``score_half_life`` tokens, and in the step that completes the prompt, that step's observation alone.
    score_kind: ClassVar[str] = "mean"
    # the observation window: a longer half-life lets stale scores pin early blocks (a worse ΔPPL on the kv bench)
    score_half_life: ClassVar[float] = 32.0
    # Whether, when the prompt completes, the passages its question names (``lexical_anchors``) are kept in every
    # lane for ``budget.anchor_tokens`` tokens (``budget.num_anchors`` of them; snap evicts once, at that point).
    keeps_anchors: ClassVar[bool] = False
    # Whether live anchors are held on top of the budget (a policy that evicts again once they expire comes back
    # to its budget then) rather than out of it (they would displace, for good, blocks in every lane).
    anchors_over_budget: ClassVar[bool] = False
    # Whether the prompt's ranking also takes the attention of ``budget.lookahead_tokens`` draft tokens.
    looks_ahead: ClassVar[bool] = False

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
        return _lowest(view, view.origin, view.num_over)


@register_policy
class HeavyHitter(EvictionPolicy):
    """Keep sinks, the recent blocks and the blocks with the highest recent attention mass
    (``score_kind = "recent"``), in a split chosen per lane.

    The split: a lane gives heavy hitters the share of the budget (past the sinks) that equals the share of
    its attention a plain window would lose, i.e. the mass on the oldest candidates the window would drop
    (at most ``budget.max_heavy_share``); the rest of its budget is the newest blocks. A lane that attends
    locally keeps a window (most lanes: on SmolLM2 at 2k tokens a window beats any attention ranking on
    perplexity), a lane that reaches back (retrieval heads) keeps what it reaches for, as DuoAttention's
    retrieval vs streaming heads (arXiv:2410.10819), decided from the attention the runner already computes.
    H2O's fixed half for every lane was worse on both counts (docs/kv-cache.md).

    Scores: each observation's block mass is taken relative to uniform attention (x the live blocks it saw),
    so a block observed while the context was small is not inflated, and averaged with a decay by age in
    tokens, so stale early scores do not pin blocks forever. When the prompt completes, its blocks are ranked
    by the prompt's last queries alone (SnapKV's observation window: the question of a prompt decides what it
    needs), and that observation replaces the scores so far: decoding goes on from the question's ranking. A
    prompt the pool could hold whole is kept whole until then (``defers_prompt``: evicting mid-prompt drops
    what the question will ask for before it is seen); a longer one streams through the pool, dropping only
    what exceeds the prompt's final budget (the peak the scheduler admits by, ``KVEvictor.peak_blocks``)."""

    name = "heavy_hitter"
    score_kind = "recent"
    defers_prompt = True
    keeps_anchors = True
    anchors_over_budget = True
    looks_ahead = True

    def __init__(self, budget: EvictionBudget) -> None:
        super().__init__(budget)
        self.scoring = ScoringSpec(True, budget.observation_window, observe_every_chunk=True)

    def num_keep_blocks(self, num_tokens: int, num_prompt_tokens: int) -> int:
        keep = self.budget.num_keep_blocks(num_tokens)
        if num_tokens < num_prompt_tokens:
            keep = max(keep, self.budget.num_keep_blocks(num_prompt_tokens))
        return keep

    def heavy_slots(self, view: BlockView) -> torch.Tensor:
        """(lanes,) long: slots each lane gives to heavy hitters (the rest of its budget is the newest)."""
        candidates = view.candidates
        score = view.score.float().nan_to_num(0.0).clamp_min(0.0)
        window_drops = candidates & (candidates.cumsum(1) <= view.num_over)  # the oldest candidates
        reach = (score * window_drops).sum(1) / (score * ~view.is_sink).sum(1).clamp_min(1e-12)
        share = reach.clamp(0.0, self.budget.max_heavy_share)
        num_sinks = int(view.is_sink[0].sum())
        heavy = (share * (view.num_keep - num_sinks)).floor().long()
        return heavy.clamp(0, max(view.num_flexible, 0))

    def select(self, view: BlockView) -> torch.Tensor:
        num_flexible = view.num_flexible
        if num_flexible <= 0 or view.num_over <= 0:
            return _lowest(view, view.origin, view.num_over)
        # How far a lane reaches is judged as if nothing were anchored (anchors sit on top of the budget): a lane
        # that copies from the anchored passage would otherwise look local and trade its heavy hitters for a
        # window
        plain = view
        if view.is_anchor is not None:
            plain = dataclasses.replace(view, is_anchor=None, num_keep=view.num_keep - view.num_over_budget)
        heavy = self.heavy_slots(plain).clamp(max=num_flexible)
        num_newest = num_flexible - heavy  # (lanes,) candidates kept for being new
        order = view.candidates.cumsum(1)  # 1-based rank among candidates, oldest first
        newest = view.candidates & (order > (view.num_candidates - num_newest).unsqueeze(1))
        key = _with_successors(view, view.score).masked_fill(newest, float("inf"))
        return _lowest(view, key, view.num_over)


@register_policy
class Snap(EvictionPolicy):
    """Once, when the prompt is complete: keep the blocks its last queries attend to most."""

    name = "snap"
    keeps_anchors = True
    looks_ahead = True

    def __init__(self, budget: EvictionBudget) -> None:
        super().__init__(budget)
        self.scoring = ScoringSpec(False, budget.observation_window, observe_every_chunk=False)

    evicts_during_prefill = False

    def triggers(self, event: StepEvent) -> bool:
        return event.is_prompt_done and event.num_live > event.num_keep

    def select(self, view: BlockView) -> torch.Tensor:
        return _lowest(view, _with_successors(view, view.score), view.num_over)


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
        """Each lane finds its own left edge; all drop as many as the lane with the fewest cold blocks (and
        at least what the budget demands), the coldest-left first."""
        candidates = view.candidates
        if view.num_candidates == 0:
            return torch.zeros_like(candidates)
        recent_mean = (view.score * view.is_recent).sum(1) / view.is_recent.sum(1).clamp_min(1)
        hot = candidates & (view.score >= self.budget.heat_fraction * recent_mean.unsqueeze(1))
        slot = torch.arange(view.origin.shape[1]).expand_as(candidates)
        left = torch.where(hot, slot, view.origin.shape[1]).amin(1, keepdim=True)  # first hot slot per lane
        cold = candidates & (slot < left)
        num = max(view.num_over, int(cold.sum(1).min()))
        return _lowest(view, view.origin, num)  # the cold blocks are the oldest candidates


def make_policy(name: str, budget: EvictionBudget) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; available: none, {', '.join(sorted(POLICIES))}")
    return POLICIES[name](budget)
