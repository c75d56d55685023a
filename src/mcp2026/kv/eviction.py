"""Eviction policies for long contexts, per layer and KV head, at block granularity (a registry).

After each step, a request whose blocks exceed its budget drops blocks, chosen separately in every *lane*
(one layer's one KV head: heads attend to different tokens, so each keeps its own heavy hitters, as H2O and
SnapKV do). Every lane drops the same number of blocks, and what each keeps is compacted, in order, into
the request's first slots (``PagedKVCache.compact``): the table then ends in slots nobody needs, which go
back to the pool (``KVCacheManager.drop_slots``). Keys are cached after RoPE, so a block read from another
slot keeps its position; which block a slot holds in each lane is tracked here (``origin``). Sinks (the first
``num_sink_tokens``) and the recent window are never dropped, so they sit in the same slots in every lane.
Policies: ``sink_window`` (StreamingLLM, arXiv:2309.17453), ``heavy_hitter`` (H2O, arXiv:2306.14048: recent
attention mass per block, relative to uniform, decayed by age; the prompt's blocks ranked by its last
queries, as SnapKV), ``snap`` (SnapKV, arXiv:2404.14469: once, after the prompt, from its last queries'
attention), ``dynamic_window`` (our notes' calcLeftBoundary: the left edge is the oldest block whose heat
is >= ``heat_fraction`` x the recent mean). ``heavy_hitter`` and ``snap`` also keep, in every lane, the passage
the prompt's question shares the most rare tokens with (``lexical_anchors``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from mcp2026.kv.layer_pages import LayerPages, Packing, layer_quotas, plan_packing
from mcp2026.kv.layer_weights import preset_name
from mcp2026.kv.manager import KVCacheManager, cdiv
from mcp2026.kv.paged_cache import PagedKVCache

log = logging.getLogger(__name__)


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
    the same reason). Block-level and forward only (docs/kv-cache.md, "Successors", has the variants): on
    the kv bench's 50 retrieval prompts at 70%, heavy_hitter kept the fact in 38 of the 44 answers the
    uncompressed cache gets right without it, 44/44 with it; ΔPPL on the 2k text +8.15% -> +8.30%."""
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
    # 32 (the observation window): at 2k tokens, 70% (bench kv, 1 sequence) ΔPPL +8.2% vs +9.7% at 256
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
        # window (one 2k text went +5.7% -> +11.4% ΔPPL that way)
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


# --- the runtime ----------------------------------------------------------------------------------------------
class Chunk(Protocol):
    request_id: str
    num_tokens: int


# (requests whose prompt just completed, draft tokens) -> request id -> (lanes, slots) draft attention
Lookahead = Callable[[list[Any], int], dict[str, torch.Tensor]]


@dataclass
class _RequestState:
    row: int  # row in the score tensors
    is_prompt_done: bool = False
    # blocks kept in every lane (lexical_anchors), chosen when the prompt completes, while fewer than
    # anchors_until tokens have been computed
    anchors: tuple[int, ...] = ()
    anchors_until: int = 0


@dataclass
class EvictionCounters:
    num_evicted_blocks: int = 0  # slots dropped (one block each, every lane); per-layer budgets: blocks freed
    num_dropped_pages: int = 0  # per-layer budgets: (layer, slot) pages dropped
    num_eviction_events: int = 0
    num_decisions: int = 0
    num_copied_chunks: int = 0  # (layer, block, head) chunks moved by compaction
    num_skipped: int = 0  # evictions put off: no free block to unshare a prefix-cache block into
    num_anchor_blocks: int = 0  # blocks chosen as prompts' lexical anchors (kept in every lane for a while)
    num_lookahead_drafts: int = 0  # prompts ranked with draft tokens' attention too
    lookahead_ms: float = 0.0  # host time drafting and rolling back
    decide_ms: float = 0.0  # host time deciding, compacting and freeing
    score_ms: float = 0.0  # host time folding step scores into the per-request tensors


class KVEvictor:
    """Applies a policy to every request of a step, after the step. Owns per-request, per-lane state, one
    (lanes, max slots) row per request that has run: the block each slot holds (``origin``), attention mass
    sums and observation counts, and for ``score_kind == "recent"`` the decayed relative mass and the last
    observation. ``cache`` None (unit tests) decides and frees slots without moving KV."""

    def __init__(
        self,
        policy: EvictionPolicy,
        manager: KVCacheManager,
        max_model_len: int,
        cache: PagedKVCache | None = None,
        num_lanes: int = 1,
        layer_weights: Sequence[float] | None = None,
    ) -> None:
        self.policy = policy
        self.budget = policy.budget
        self.manager = manager
        self.cache = cache
        self.num_lanes = cache.num_layers * cache.num_kv_heads if cache is not None else num_lanes
        # Per-layer budgets: the request's kept blocks shared between layers in proportion to these weights
        # (kv.layer_pages packs each layer's slots into the request's blocks)
        self.layer_weights = None if layer_weights is None else [float(w) for w in layer_weights]
        self.layer_pages: LayerPages | None = None
        if self.layer_weights is not None:
            if cache is None or not cache.layered:
                raise ValueError("per-layer budgets need a layered KV cache (PagedKVCache(layered=True))")
            if len(self.layer_weights) != cache.num_layers or min(self.layer_weights) <= 0:
                raise ValueError(
                    f"KVCompressor.layer_weights: {len(self.layer_weights)} weights for a model of "
                    f"{cache.num_layers} layers; give one per layer, each positive"
                )
            self.layer_pages = LayerPages(cache.num_layers, cache.num_blocks)
        # Calibration (kv.calibrate): only this layer evicts, at the uniform budget; the others keep all they
        # hold. Per-layer budgets only (it needs the layered cache).
        self.probe_layer: int | None = None
        self.max_blocks = cdiv(max_model_len, self.budget.block_size)
        shape = (0, self.num_lanes, self.max_blocks)
        self.origin = torch.zeros(shape, dtype=torch.long)
        self.mass = torch.zeros(shape)
        self.count = torch.zeros(shape)
        self.recent = torch.zeros(shape)  # decayed mass relative to uniform ("recent" scores)
        self.last = torch.zeros(shape)  # the last observation, relative to uniform
        self._states: dict[str, _RequestState] = {}
        self._free_rows: list[int] = []
        self.counters = EvictionCounters()

    @property
    def scoring(self) -> ScoringSpec:
        return self.policy.scoring

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` holds at once when prefilled in chunks of at most
        ``chunk_tokens``: all of them, unless the policy evicts during prefill; then the blocks it keeps plus
        one chunk's (and the partly filled block the chunk starts in). A policy that ``defers_prompt`` holds
        a prompt the pool could hold whole."""
        bs = self.budget.block_size
        full = cdiv(num_tokens, bs)
        if not self.policy.evicts_during_prefill or self._defers(num_tokens):
            return full
        return min(full, self.budget.num_keep_blocks(num_tokens) + cdiv(chunk_tokens, bs) + 1)

    def _defers(self, num_prompt_tokens: int) -> bool:
        return self.policy.defers_prompt and self.manager.can_ever_fit(num_prompt_tokens)

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.origin, self.mass, self.count, self.recent, self.last

    def _state(self, request_id: str) -> _RequestState:
        state = self._states.get(request_id)
        if state is None:
            if not self._free_rows:
                old = self.mass.shape[0]
                new = max(8, 2 * old)
                self.origin, self.mass, self.count, self.recent, self.last = (
                    torch.cat([t, t.new_zeros(new - old, *t.shape[1:])]) for t in self._tensors()
                )
                self._free_rows = list(range(new - 1, old - 1, -1))
            state = self._states[request_id] = _RequestState(self._free_rows.pop())
            self.origin[state.row] = torch.arange(self.max_blocks)
        return state

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests finished or were preempted (a recompute starts from a full context again)."""
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if self.layer_pages is not None:
                self.layer_pages.forget(rid)
            if state is not None:
                for t in self._tensors():
                    t[state.row].zero_()
                self._free_rows.append(state.row)

    def origins(self, request_id: str, num_slots: int) -> torch.Tensor:
        """(lanes, num_slots): the block each of the request's first slots holds in every lane."""
        row = self._state(request_id).row  # first: a new request may grow (replace) the tensors
        return self.origin[row, :, :num_slots].clone()

    def lane_origins(self, request_id: str, num_slots: int) -> list[list[int]]:
        """Per lane, the block each of its slots holds when the uniform view has ``num_slots`` slots: with
        per-layer budgets, a layer's lanes hold ``num_slots - slot_shift[layer]``."""
        origin = self.origins(request_id, self.max_blocks).tolist()
        if self.layer_pages is None:
            return [lane[:num_slots] for lane in origin]
        lane_slots = num_slots - self.layer_pages.lane_shift(request_id, self.cache.num_kv_heads)
        return [lane[:n] for lane, n in zip(origin, lane_slots.tolist())]

    def absorb(self, scores: Iterable[StepScores], num_new_tokens: dict[str, int] | None = None) -> None:
        """Fold a step's observations in. ``num_new_tokens``: tokens each request computed in the step (the
        age, for the decay of "recent" scores; 1 when not given)."""
        t0 = time.perf_counter()
        recent = self.policy.score_kind == "recent"
        for part in scores:
            for i, (rid, n) in enumerate(zip(part.request_ids, part.num_slots)):
                row = self._state(rid).row
                if self.layer_pages is not None and self.layer_pages.is_packed(rid):
                    self._absorb_layered(row, part.mass[i], n, rid, (num_new_tokens or {}).get(rid, 1))
                    continue
                mass = part.mass[i, :, :n].float()
                if recent:
                    rel = mass * n  # relative to uniform over the blocks this observation saw
                    age = float((num_new_tokens or {}).get(rid, 1))
                    keep = 0.5 ** (age / self.policy.score_half_life)
                    old = self.recent[row, :, :n]
                    seen = self.count[row, :, :n] > 0  # a block's first observation is its score
                    self.recent[row, :, :n] = torch.where(seen, keep * old + (1.0 - keep) * rel, rel)
                    self.last[row, :, :n] = rel  # slots past n are zero (compaction zeroes what it vacates)
                self.mass[row, :, :n] += mass
                self.count[row, :, :n] += 1.0
        self.counters.score_ms += (time.perf_counter() - t0) * 1e3

    def _absorb_layered(
        self, row: int, mass: torch.Tensor, num_slots: int, request_id: str, age: int
    ) -> None:
        """``absorb`` for a request whose layers hold different numbers of slots: lane by lane, only its own."""
        lane_slots = num_slots - self.layer_pages.lane_shift(request_id, self.cache.num_kv_heads)  # (lanes,)
        n = int(lane_slots.max())
        valid = torch.arange(n).unsqueeze(0) < lane_slots.unsqueeze(1)  # (lanes, n)
        mass = mass[:, :n].float() * valid
        if self.policy.score_kind == "recent":
            rel = mass * lane_slots.unsqueeze(1)
            keep = 0.5 ** (float(age) / self.policy.score_half_life)
            old = self.recent[row, :, :n]
            seen = self.count[row, :, :n] > 0
            updated = torch.where(seen, keep * old + (1.0 - keep) * rel, rel)
            self.recent[row, :, :n] = torch.where(valid, updated, old)
            self.last[row, :, :n] = torch.where(valid, rel, self.last[row, :, :n])
        self.mass[row, :, :n] += mass
        self.count[row, :, :n] += valid.float()

    def after_step(
        self,
        chunks: Iterable[Chunk],
        scores: Iterable[StepScores],
        get_request: Callable[[str], Any],
        lookahead: Lookahead | None = None,
    ) -> int:
        """Fold the step's scores in, then evict for every request that ran. Returns slots dropped.
        ``lookahead``: drafts for the requests whose prompt completes in this step (``engine.lookahead``)."""
        chunks = list(chunks)
        self.absorb(scores, {c.request_id: c.num_tokens for c in chunks})
        drafts = self._lookahead(chunks, get_request, lookahead)
        t0 = time.perf_counter()
        num_evicted = 0
        bs = self.budget.block_size
        for chunk in chunks:
            request = get_request(chunk.request_id)
            if request is None or request.is_finished or request.num_computed_tokens == 0:
                continue
            is_prompt_done = self._completes_prompt(request)
            state = self._state(chunk.request_id)
            n = request.num_computed_tokens
            state.is_prompt_done = state.is_prompt_done or is_prompt_done
            num_live = cdiv(n - self.manager.num_dropped_tokens(chunk.request_id), bs)
            widest = (
                num_live  # the widest layer's slots (per-layer budgets: a layer may hold more than num_live)
            )
            if self.layer_pages is not None:
                widest -= min(self.layer_pages.slot_shift(chunk.request_id))
            if is_prompt_done and chunk.request_id in drafts:
                self._fold_draft(state.row, drafts[chunk.request_id][:, :widest])
            if is_prompt_done and self.policy.score_kind == "recent":
                self.recent[state.row] = self.last[state.row]
            num_keep = self.policy.num_keep_blocks(n, request.num_prompt_tokens)
            if is_prompt_done and self.policy.keeps_anchors and self.budget.num_anchors > 0:
                state.anchors = self._anchors(request.prompt_token_ids, state.row, widest, num_keep, n)
                # from the prompt's end: a recompute after preemption passes it in one chunk
                state.anchors_until = request.num_prompt_tokens + self.budget.anchor_tokens
                self.counters.num_anchor_blocks += len(state.anchors)
            # on top of the budget only where that stays under the admitted peak (the whole prompt); anchors a sink
            # or the recent window protects anyway count for nothing
            over_budget = 0
            live = state.anchors and n < state.anchors_until
            if self.policy.anchors_over_budget and live and self._defers(request.num_tokens):
                first_recent, sinks = self.budget.first_recent_block(n), self.budget.num_sink_blocks()
                over_budget = sum(1 for a in state.anchors if sinks <= a < first_recent)
            event = StepEvent(
                num_live=num_live,
                num_keep=num_keep + over_budget,
                num_over_budget=over_budget,
                is_prompt_done=is_prompt_done,
                is_block_boundary=(n // bs) != (n - chunk.num_tokens) // bs,
            )
            # The prompt stays whole until its last chunk. The test is on num_tokens, as in peak_blocks (what the
            # scheduler admitted by): a recompute after preemption runs past the prompt end in one chunk.
            if n < request.num_prompt_tokens and self._defers(request.num_tokens):
                continue
            if self.policy.triggers(event):
                num_evicted += self._evict(chunk.request_id, state, n, event, is_prompt_done)
        self.counters.decide_ms += (time.perf_counter() - t0) * 1e3
        return num_evicted

    def _completes_prompt(self, request: Any) -> bool:
        """Whether this step computed the request's last prompt token (the first time it did)."""
        if request is None or request.is_finished or request.num_computed_tokens < request.num_prompt_tokens:
            return False
        state = self._states.get(request.request_id)
        return state is None or not state.is_prompt_done

    def _lookahead(
        self, chunks: list[Chunk], get_request: Callable[[str], Any], lookahead: Lookahead | None
    ) -> dict[str, torch.Tensor]:
        """Draft attention of the requests whose prompt completes in this step (nothing without a hook)."""
        num_tokens = self.budget.lookahead_tokens
        if lookahead is None or num_tokens <= 0 or not self.policy.looks_ahead:
            return {}
        requests = [r for r in map(get_request, (c.request_id for c in chunks)) if self._completes_prompt(r)]
        if not requests:
            return {}
        t0 = time.perf_counter()
        try:
            drafts = lookahead(requests, num_tokens)
        except Exception:  # noqa: BLE001 - drafts only refine a ranking: a failed one must not fail the step
            log.exception("lookahead drafts failed; ranking the prompts by their own queries")
            drafts = {}
        self.counters.lookahead_ms += (time.perf_counter() - t0) * 1e3
        self.counters.num_lookahead_drafts += len(drafts)
        return drafts

    def _fold_draft(self, row: int, draft: torch.Tensor) -> None:
        """Blend the drafts' attention (relative to uniform) into the prompt's observation, with weight
        ``budget.lookahead_weight``."""
        w, n = self.budget.lookahead_weight, draft.shape[1]
        if self.policy.score_kind == "recent":
            self.last[row, :, :n] = (1.0 - w) * self.last[row, :, :n] + w * draft
        else:  # mean attention per observation: the draft's relative mass back to a share (/ n)
            prompt = self.mass[row, :, :n] / self.count[row, :, :n].clamp_min(1.0)
            self.mass[row, :, :n] = (1.0 - w) * prompt + w * draft / n
            self.count[row, :, :n] = 1.0

    def _anchors(
        self, prompt_ids: Sequence[int], row: int, num_live: int, num_keep: int, num_tokens: int
    ) -> tuple[int, ...]:
        """The prompt's lexical anchors, best passage first, as many passages as fit in half the flexible budget
        (a small budget stays the policy's own); a passage counts only if every lane still holds its first
        block (a prompt streamed through the pool may have lost it), and then keeps what every lane holds."""
        b = self.budget
        passages = lexical_anchors(
            prompt_ids, b.block_size, b.observation_window, b.num_anchors, max(1, b.num_sink_blocks())
        )
        origin = self.origin[row, :, :num_live]
        room = (num_keep - b.num_protected(num_tokens)) // 2
        anchors: list[int] = []
        for passage in passages:
            held = [a for a in passage if bool((origin == a).any(1).all())]
            if not held or held[0] != passage[0] or len(anchors) + len(held) > room:
                continue
            anchors += [a for a in held if a not in anchors]
        return tuple(sorted(anchors))

    def score(self, row: int, num_slots: int, is_prompt_done: bool = False) -> torch.Tensor:
        """(lanes, num_slots) the policy's score of one request's slots (``EvictionPolicy.score_kind``)."""
        if self.policy.score_kind == "recent":
            return (self.last if is_prompt_done else self.recent)[row, :, :num_slots].clone()
        return self.mass[row, :, :num_slots] / self.count[row, :, :num_slots].clamp_min(1.0)

    def _evict(
        self, request_id: str, state: _RequestState, num_tokens: int, event: StepEvent, is_prompt_done: bool
    ) -> int:
        if self.layer_pages is not None:
            return self._evict_layered(request_id, state, num_tokens, event, is_prompt_done)
        self.counters.num_decisions += 1
        n = event.num_live
        origin = self.origin[state.row, :, :n]
        view = BlockView(
            num_tokens=num_tokens,
            origin=origin,
            is_sink=origin < self.budget.num_sink_blocks(),
            is_recent=origin >= self.budget.first_recent_block(num_tokens),
            score=self.score(state.row, n, is_prompt_done),
            num_keep=event.num_keep,
            is_prompt_end=is_prompt_done,
            is_anchor=torch.isin(origin, torch.tensor(state.anchors))
            if state.anchors and num_tokens < state.anchors_until
            else None,
            num_over_budget=event.num_over_budget,
        )
        chosen = self.policy.select(view)
        num_dropped = int(chosen[0].sum())
        if num_dropped == 0:
            return 0
        assert bool((chosen.sum(1) == num_dropped).all()), f"policy {self.policy.name}: uneven lanes"
        assert not bool((chosen & ~view.candidates).any()), (
            f"policy {self.policy.name} chose a protected block"
        )
        slots = torch.arange(n).expand(self.num_lanes, n)
        source = slots[~chosen].view(self.num_lanes, n - num_dropped)  # kept slots, in order, per lane
        moved = (source != slots[:, : n - num_dropped]).any(0)  # slots whose content changes in some lane
        rewrite_from = int(moved.int().argmax()) if bool(moved.any()) else n - num_dropped
        tables = self.manager.drop_slots(request_id, n, num_dropped, rewrite_from)
        if tables is None:
            self.counters.num_skipped += 1
            return 0
        if self.cache is not None:
            self.counters.num_copied_chunks += self.cache.compact(*tables, source)
        m = n - num_dropped
        for t in self._tensors():
            t[state.row, :, :m] = t[state.row, :, :n].gather(1, source)
            t[state.row, :, m:n] = 0
        # later slots hold the blocks after the tail (the last slot holds the last block in every lane)
        self.origin[state.row, :, m:] = (
            torch.arange(m, self.max_blocks) + cdiv(num_tokens, self.budget.block_size) - m
        )
        self.counters.num_evicted_blocks += num_dropped
        self.counters.num_eviction_events += 1
        return num_dropped

    def _evict_layered(
        self, request_id: str, state: _RequestState, num_tokens: int, event: StepEvent, is_prompt_done: bool
    ) -> int:
        """Per-layer budgets: the request keeps ``event.num_keep`` blocks' worth of pages, shared between layers
        by ``layer_weights`` (water-filled: a layer holding less than its share keeps all it holds); each layer's
        policy decision is the uniform one at its own budget, then ``plan_packing`` lays the kept slots into the
        fewest blocks and the rest go back to the pool. Blocks it writes into are made the request's own first
        (``privatize``: a shared prefix that nothing rewrites stays shared)."""
        self.counters.num_decisions += 1
        pages_of, cache = self.layer_pages, self.cache
        nkv, num_layers = cache.num_kv_heads, cache.num_layers
        table = self.manager.block_table(request_id)
        if len(table) != event.num_live:  # blocks allocated ahead of the computed tokens: wait for them
            self.counters.num_skipped += 1
            return 0
        shift = pages_of.slot_shift(request_id)
        num_slots = [event.num_live - s for s in shift]
        score = self.score(state.row, max(num_slots), is_prompt_done)
        anchors = torch.tensor(state.anchors) if state.anchors and num_tokens < state.anchors_until else None
        views = []
        for layer, n in enumerate(num_slots):
            lanes = slice(layer * nkv, (layer + 1) * nkv)
            origin = self.origin[state.row, lanes, :n]
            views.append(
                BlockView(
                    num_tokens=num_tokens,
                    origin=origin,
                    is_sink=origin < self.budget.num_sink_blocks(),
                    is_recent=origin >= self.budget.first_recent_block(num_tokens),
                    score=score[lanes, :n],
                    num_keep=n,
                    is_prompt_end=is_prompt_done,
                    is_anchor=None if anchors is None else torch.isin(origin, anchors),
                    num_over_budget=event.num_over_budget,
                )
            )
        floors = [n - v.num_candidates for n, v in zip(num_slots, views)]
        if self.probe_layer is None:
            quotas = layer_quotas(self.layer_weights, num_layers * event.num_keep, num_slots, floors)
        else:
            quotas = [
                min(n, max(event.num_keep, f)) if i == self.probe_layer else n
                for i, (n, f) in enumerate(zip(num_slots, floors))
            ]
        # one policy call per group of layers with the same slots and budget (its lanes side by side): on SmolLM2's
        # calibrated weights 14 layers share the smallest share
        groups: dict[tuple[int, int], list[int]] = {}
        for layer, (n, keep) in enumerate(zip(num_slots, quotas)):
            groups.setdefault((n, keep), []).append(layer)
        sources: list[torch.Tensor] = [torch.empty(0)] * num_layers
        for (n, keep), layers in groups.items():
            parts = [views[layer] for layer in layers]

            def cat(name: str, parts: list[BlockView] = parts) -> torch.Tensor | None:
                values = [getattr(v, name) for v in parts]
                return None if values[0] is None else torch.cat(values)

            # keep <= n: a layer under its share may still drop (dynamic_window's cold blocks)
            view = dataclasses.replace(
                parts[0],
                origin=cat("origin"),
                is_sink=cat("is_sink"),
                is_recent=cat("is_recent"),
                score=cat("score"),
                is_anchor=cat("is_anchor"),
                num_keep=keep,
            )
            chosen = self.policy.select(view)
            num_dropped = int(chosen[0].sum())
            assert bool((chosen.sum(1) == num_dropped).all()), f"policy {self.policy.name}: uneven lanes"
            assert not bool((chosen & ~view.candidates).any()), (
                f"policy {self.policy.name} chose a protected block"
            )
            kept = (
                torch.arange(n).expand(len(layers) * nkv, n)[~chosen].view(len(layers), nkv, n - num_dropped)
            )
            for layer, source in zip(layers, kept):
                sources[layer] = source
        num_dropped = sum(num_slots) - sum(s.shape[1] for s in sources)
        if num_dropped == 0:
            return 0
        packing = plan_packing(pages_of.pages(request_id, table), sources, table, cache.num_blocks, nkv)
        # the entries it writes must hold nobody else's KV: shared or prefix-cached blocks move to fresh ones first
        nb = cache.num_blocks
        written = (packing.dst[packing.src != packing.dst] // nkv) % nb
        where = {b: i for i, b in enumerate(table)}
        tables = self.manager.privatize(request_id, sorted({where[int(b)] for b in written.unique()}))
        if tables is None:
            self.counters.num_skipped += 1
            return 0
        packing = self._repoint(packing, *tables)
        self.counters.num_copied_chunks += cache.move_chunks(packing.src, packing.dst)
        self.manager.release_slots(request_id, packing.released)
        pages_of.set(request_id, packing.pages, len(table) - len(packing.released))
        row, first_new = state.row, cdiv(num_tokens, self.budget.block_size)
        for layer, (n, source) in enumerate(zip(num_slots, sources)):
            lanes = slice(layer * nkv, (layer + 1) * nkv)
            m = source.shape[1]
            for t in self._tensors():
                t[row, lanes, :m] = t[row, lanes, :n].gather(1, source)
                t[row, lanes, m:n] = 0
            self.origin[row, lanes, m:] = torch.arange(m, self.max_blocks) + first_new - m
        self.counters.num_dropped_pages += num_dropped
        self.counters.num_evicted_blocks += len(packing.released)
        self.counters.num_eviction_events += 1
        return len(packing.released)

    def _repoint(self, packing: Packing, before: list[int], after: list[int]) -> Packing:
        """``packing`` after ``privatize`` replaced blocks with fresh ones: every destination page of an old block
        (and the new layout) points at the same page of its new block, and the old blocks' other chunks are copied
        over too. The sources stay the old blocks, whose bytes are intact until the next allocation:
        ``move_chunks`` reads every source before it writes, so one call does both."""
        changed = {b: a for b, a in zip(before, after) if b != a}
        if not changed:
            return packing
        nb, nkv = self.cache.num_blocks, self.cache.num_kv_heads
        block_map = torch.arange(nb)
        block_map[torch.tensor(list(changed))] = torch.tensor(list(changed.values()))

        def repoint(ids: torch.Tensor) -> torch.Tensor:
            page, head = ids // nkv, ids % nkv
            return ((page // nb) * nb + block_map[page % nb]) * nkv + head

        dst = repoint(packing.dst)
        whole = self.cache.block_chunks(list(changed))  # to the same chunks of the new blocks
        rest = whole[~torch.isin(repoint(whole), dst)]
        layout = [[(p // nb) * nb + changed.get(p % nb, p % nb) for p in layer] for layer in packing.pages]
        return Packing(
            layout, packing.released, torch.cat([rest, packing.src]), torch.cat([repoint(rest), dst])
        )

    def report(self) -> dict:
        c = self.counters
        return {
            "policy": self.policy.name,
            "num_evicted_blocks": c.num_evicted_blocks,
            "num_dropped_pages": c.num_dropped_pages,
            "num_eviction_events": c.num_eviction_events,
            "num_decisions": c.num_decisions,
            "num_copied_chunks": c.num_copied_chunks,
            "num_skipped": c.num_skipped,
            "num_anchor_blocks": c.num_anchor_blocks,
            "num_lookahead_drafts": c.num_lookahead_drafts,
            "lookahead_ms": c.lookahead_ms,
            "decide_ms": c.decide_ms,
            "score_ms": c.score_ms,
            "num_tracked_requests": len(self._states),
            "layer_budgets": self._layer_report(),
        }

    def _layer_report(self) -> dict | None:
        """Per-layer budgets: the weights, the requests packed, and the pages their blocks hold that no slot uses
        (at most layers - 1 per request: what packing into whole blocks costs)."""
        if self.layer_pages is None:
            return None
        packed = [rid for rid in self._states if self.layer_pages.is_packed(rid)]
        idle = 0
        for rid in packed:
            table = self.manager.block_table(rid)
            used = sum(len(p) for p in self.layer_pages.pages(rid, table))
            idle += len(self.layer_weights) * len(table) - used
        return {
            "layer_weights": list(self.layer_weights),
            "preset": preset_name(self.layer_weights),
            "num_packed_requests": len(packed),
            "num_idle_pages": idle,
        }
