"""Lookahead queries for KV eviction: before a prompt's blocks are ranked, the model drafts a few tokens greedily
over the whole prompt, the drafts' attention is returned as an observation, and the drafts are rolled back.

Why: at the end of a long prompt, the question's own attention often misses what the answer will copy (a
135M model finds a fact only while writing "... the code is", in lanes that ignored it while reading the
question; docs/kv-cache.md). The draft's queries are the answer's queries, computed while every prompt block
is still there. Nothing of the draft stays: its KV slots, the blocks it took and the request's staged int4
tail are restored, so the real decode starts from the state the prompt left (``test_lookahead``: with
nothing evicted, outputs are identical with and without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.engine.runner import ModelRunner
from mcp2026.kv.manager import KVCacheManager, cdiv


@dataclass
class _Draft:
    """What ``KVCacheManager.allocate_slots`` reads of a request, at the draft's position."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    cache_salt: str | None = None
    plan_id: str | None = None


def _wants_draft(request: Any, eos_token_ids: Sequence[int]) -> bool:
    """A next token is known and the request goes on after it (a draft for a finishing request is waste)."""
    n = request.num_computed_tokens
    if n >= request.num_tokens:
        return False
    params = request.sampling_params
    if params is None:  # teacher-forced measurement: the text goes on
        return True
    if request.num_output_tokens >= params.max_tokens:
        return False
    return params.ignore_eos or request.all_token_ids[n] not in eos_token_ids


@torch.inference_mode()
def draft_attention(
    runner: ModelRunner,
    manager: KVCacheManager,
    requests: Sequence[Any],
    num_tokens: int,
    max_model_len: int,
    eos_token_ids: Sequence[int] = (),
) -> dict[str, torch.Tensor]:
    """Per request (request id -> (lanes, live slots) float32): the mean attention, relative to uniform, that
    up to ``num_tokens`` greedy draft tokens pay to each of the request's slots. The first draft token is the
    request's next known token (the one sampled from the prompt); drafts stop at EOS, at the context limit or
    when the pool has no block. All requests draft together, one decode batch per token; afterwards their
    tables and staged tails are as before."""
    cache = runner.cache
    bs = cache.block_size
    live = [r for r in requests if _wants_draft(r, eos_token_ids)]
    if num_tokens <= 0 or not live:
        return {}
    table_lens = {r.request_id: len(manager.block_table(r.request_id)) for r in live}
    staged = cache.save_staging([r.request_id for r in live])
    num_slots = {
        r.request_id: cdiv(r.num_computed_tokens - manager.num_dropped_tokens(r.request_id), bs) for r in live
    }
    # per lane, the prompt's slots: with per-layer budgets (kv.layer_pages) a layer holds ``slot_shift`` fewer
    pages, lanes = runner.layer_pages, cache.num_layers * cache.num_kv_heads
    no_shift = torch.zeros(lanes, dtype=torch.long)
    lane_slots = {  # (lanes,) each
        rid: n - (no_shift if pages is None else pages.lane_shift(rid, cache.num_kv_heads))
        for rid, n in num_slots.items()
    }
    sums = {rid: torch.zeros(lanes, int(s.max())) for rid, s in lane_slots.items()}
    counts = dict.fromkeys(num_slots, 0)
    drafts = {
        r.request_id: _Draft(r.request_id, r.num_computed_tokens, r.num_tokens, r.cache_salt, r.plan_id)
        for r in live
    }
    tokens = {r.request_id: r.all_token_ids[r.num_computed_tokens] for r in live}
    scoring = runner.scoring
    runner.scoring = dataclasses.replace(scoring, decode=True)
    try:
        for _ in range(num_tokens):
            chunks = []
            for rid, draft in list(drafts.items()):
                if draft.num_computed_tokens + 1 >= max_model_len or not manager.allocate_slots(
                    draft, 1, evict_cached=False
                ):
                    del drafts[rid]
                    continue
                chunks.append(
                    ScheduledChunk(
                        rid,
                        [tokens[rid]],
                        draft.num_computed_tokens,
                        manager.block_table(rid),
                        True,
                        kv_offset=manager.num_dropped_tokens(rid),
                    )
                )
            if not chunks:
                break
            ids, logits = runner.execute(SchedulerOutput(chunks, len(chunks)))
            for part in runner.take_scores():
                for i, (rid, seen) in enumerate(zip(part.request_ids, part.num_slots)):
                    seen_by_lane = (seen - num_slots[rid] + lane_slots[rid]).unsqueeze(1)  # (lanes, 1)
                    n = sums[rid].shape[1]  # relative to uniform over what each lane saw
                    sums[rid] += part.mass[i, :, :n].float() * seen_by_lane
                    counts[rid] += 1
            for rid, token in zip(ids, logits.argmax(-1).tolist()):
                drafts[rid].num_computed_tokens += 1
                drafts[rid].num_tokens += 1
                tokens[rid] = token
                if token in eos_token_ids:
                    del drafts[rid]
    finally:
        runner.scoring = scoring
        for rid, n in table_lens.items():
            manager.truncate(rid, n)
        cache.restore_staging(staged)
    return {rid: sums[rid] / counts[rid] for rid in sums if counts[rid]}
