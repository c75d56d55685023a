"""The eviction runtime: after every step, applies an ``EvictionPolicy`` (``kv.eviction``) to each request
that ran, lane by lane, and compacts what each lane keeps into the request's first slots.

What a slot holds and how hot it is lives in ``kv.lane_scores``; dropped slots go back to the pool through
``KVCacheManager.drop_slots`` (with per-layer budgets, ``kv.layer_pages`` packs each layer's kept slots into the
fewest blocks). Also chooses a prompt's lexical anchors when it completes, and asks for lookahead drafts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mcp2026.kv.eviction import BlockView, EvictionPolicy, ScoringSpec, StepEvent, StepScores, lexical_anchors
from mcp2026.kv.lane_scores import LaneScores
from mcp2026.kv.layer_pages import LayerPages, layer_quotas, plan_packing, repoint_packing
from mcp2026.kv.layer_weights import preset_name
from mcp2026.kv.manager import KVCacheManager, cdiv
from mcp2026.kv.paged_cache import PagedKVCache

log = logging.getLogger(__name__)


class Chunk(Protocol):
    request_id: str
    num_tokens: int


# (requests whose prompt just completed, draft tokens) -> request id -> (lanes, slots) draft attention
Lookahead = Callable[[list[Any], int], dict[str, torch.Tensor]]


@dataclass
class _RequestState:
    row: int  # row in the LaneScores tensors
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
    """Applies a policy to every request of a step, after the step. Owns per-request, per-lane state
    (``scores``: one row per request that has run). ``cache`` None (unit tests) decides and frees slots
    without moving KV."""

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
        self.scores = LaneScores(self.num_lanes, self.max_blocks, policy.score_kind, policy.score_half_life)
        self._states: dict[str, _RequestState] = {}
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

    def _state(self, request_id: str) -> _RequestState:
        state = self._states.get(request_id)
        if state is None:
            state = self._states[request_id] = _RequestState(self.scores.allocate_row())
        return state

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests finished or were preempted (a recompute starts from a full context again)."""
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if self.layer_pages is not None:
                self.layer_pages.forget(rid)
            if state is not None:
                self.scores.free_row(state.row)

    def origins(self, request_id: str, num_slots: int) -> torch.Tensor:
        """(lanes, num_slots): the block each of the request's first slots holds in every lane."""
        row = self._state(request_id).row  # first: a new request may grow (replace) the tensors
        return self.scores.origin[row, :, :num_slots].clone()

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
        ages = num_new_tokens or {}
        for part in scores:
            for i, (rid, n) in enumerate(zip(part.request_ids, part.num_slots)):
                row = self._state(rid).row
                if self.layer_pages is not None and self.layer_pages.is_packed(rid):
                    lane_slots = n - self.layer_pages.lane_shift(rid, self.cache.num_kv_heads)  # (lanes,)
                    self.scores.observe_lanes(row, part.mass[i], lane_slots, ages.get(rid, 1))
                else:
                    self.scores.observe(row, part.mass[i], n, ages.get(rid, 1))
        self.counters.score_ms += (time.perf_counter() - t0) * 1e3

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
                self.scores.fold_draft(
                    state.row, drafts[chunk.request_id][:, :widest], self.budget.lookahead_weight
                )
            if is_prompt_done and self.policy.score_kind == "recent":
                self.scores.restart_from_last(state.row)
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
        origin = self.scores.origin[row, :, :num_live]
        room = (num_keep - b.num_protected(num_tokens)) // 2
        anchors: list[int] = []
        for passage in passages:
            held = [a for a in passage if bool((origin == a).any(1).all())]
            if not held or held[0] != passage[0] or len(anchors) + len(held) > room:
                continue
            anchors += [a for a in held if a not in anchors]
        return tuple(sorted(anchors))

    def _evict(
        self, request_id: str, state: _RequestState, num_tokens: int, event: StepEvent, is_prompt_done: bool
    ) -> int:
        if self.layer_pages is not None:
            return self._evict_layered(request_id, state, num_tokens, event, is_prompt_done)
        self.counters.num_decisions += 1
        n = event.num_live
        origin = self.scores.origin[state.row, :, :n]
        view = BlockView(
            num_tokens=num_tokens,
            origin=origin,
            is_sink=origin < self.budget.num_sink_blocks(),
            is_recent=origin >= self.budget.first_recent_block(num_tokens),
            score=self.scores.score(state.row, n, is_prompt_done),
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
        self.scores.compact(state.row, slice(None), source, n, num_tokens, self.budget.block_size)
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
        score = self.scores.score(state.row, max(num_slots), is_prompt_done)
        anchors = torch.tensor(state.anchors) if state.anchors and num_tokens < state.anchors_until else None
        views = []
        for layer, n in enumerate(num_slots):
            lanes = slice(layer * nkv, (layer + 1) * nkv)
            origin = self.scores.origin[state.row, lanes, :n]
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
        changed = {b: a for b, a in zip(*tables) if b != a}
        if changed:  # the old blocks' whole chunks, for the other layers' pages of them
            packing = repoint_packing(packing, changed, cache.block_chunks(list(changed)), nb, nkv)
        self.counters.num_copied_chunks += cache.move_chunks(packing.src, packing.dst)
        self.manager.release_slots(request_id, packing.released)
        pages_of.set(request_id, packing.pages, len(table) - len(packing.released))
        for layer, (n, source) in enumerate(zip(num_slots, sources)):
            lanes = slice(layer * nkv, (layer + 1) * nkv)
            self.scores.compact(state.row, lanes, source, n, num_tokens, self.budget.block_size)
        self.counters.num_dropped_pages += num_dropped
        self.counters.num_evicted_blocks += len(packing.released)
        self.counters.num_eviction_events += 1
        return len(packing.released)

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
