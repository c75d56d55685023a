"""Eviction: budgets, which blocks each policy drops, holes in block tables, pool integrity, prefix rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mcp2026.kv.eviction import BlockView, EvictionBudget, KVEvictor, StepScores, make_policy
from mcp2026.kv.manager import HOLE, KVCacheManager

BS = 4


def budget(**kw) -> EvictionBudget:
    args = dict(block_size=BS, num_sink_tokens=4, recent_window=8, sparsity_ratio=0.5, max_kv_tokens=None)
    args.update(kw)
    return EvictionBudget(**args)


def view(b: EvictionBudget, num_tokens: int, score=None, live=None) -> BlockView:
    nb = -(-num_tokens // BS)
    index = torch.arange(nb)
    return BlockView(
        num_tokens=num_tokens,
        is_live=torch.ones(nb, dtype=torch.bool) if live is None else torch.tensor(live),
        is_sink=index < b.num_sink_blocks(),
        is_recent=index >= b.first_recent_block(num_tokens),
        score=torch.zeros(nb) if score is None else torch.tensor(score, dtype=torch.float32),
        num_keep=b.num_keep_blocks(num_tokens),
    )


def test_budget_blocks():
    b = budget()
    assert b.num_sink_blocks() == 1 and b.first_recent_block(40) == 8
    assert b.num_protected(40) == 1 + 2 and b.num_keep_blocks(40) == 5  # 20 tokens kept
    assert budget(sparsity_ratio=0.0).num_keep_blocks(41) == 11  # nothing dropped
    assert budget(sparsity_ratio=None, max_kv_tokens=24).num_keep_blocks(400) == 6
    assert budget(sparsity_ratio=0.99).num_keep_blocks(40) == 3  # never below sinks + recent


def test_sink_window_drops_the_oldest():
    b = budget()
    chosen = make_policy("sink_window", b).select(view(b, 40))
    assert chosen.tolist() == [1, 2, 3, 4, 5]  # keeps block 0 (sink), 6, 7 (older budget) and 8, 9 (recent)


def test_heavy_hitter_keeps_high_scores_and_protects_sink_and_recent():
    b = budget()
    score = [0.0, 5, 1, 9, 2, 0.5, 7, 3, 0, 0]
    chosen = make_policy("heavy_hitter", b).select(view(b, 40, score))
    assert sorted(chosen.tolist()) == [1, 2, 4, 5, 7]  # keeps sink 0, recent 8 and 9, the hottest 3 and 6


def test_heavy_hitter_respects_existing_holes():
    b = budget()
    live = [True, False, True, True, False, True, True, True, True, True]
    chosen = make_policy("heavy_hitter", b).select(view(b, 40, [0, 0, 3, 1, 0, 2, 4, 0, 0, 0], live))
    assert sorted(chosen.tolist()) == [3, 5, 7]  # 8 live -> 5; holes are never chosen again


def test_snap_only_after_the_prompt():
    from mcp2026.kv.eviction import StepEvent

    policy = make_policy("snap", budget())
    assert policy.scoring.observe_window == 32 and not policy.scoring.decode
    assert policy.triggers(StepEvent(10, 5, is_prompt_done=True, is_block_boundary=False))
    assert not policy.triggers(StepEvent(10, 5, is_prompt_done=False, is_block_boundary=True))


def test_dynamic_window_left_boundary():
    b = budget(sparsity_ratio=0.0)  # no cap: the heat alone decides
    #       sink  cold cold  hot  cold  cold | recent (mean heat 2.0)
    score = [9.0, 0.1, 0.5, 1.3, 0.2, 0.1, 2.0, 2.0]
    chosen = make_policy("dynamic_window", b).select(view(b, 32, score))
    assert chosen.tolist() == [1, 2]  # left edge = block 3, the oldest with heat >= 0.6 x 2.0
    capped = budget(sparsity_ratio=0.5)  # keep 4 blocks: the oldest of the window go too
    chosen = make_policy("dynamic_window", capped).select(view(capped, 32, score))
    assert chosen.tolist() == [1, 2, 3, 4]


# --- the manager and the runtime ---------------------------------------------------------------------------
@dataclass
class Req:
    request_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    plan_id: str | None = None
    is_finished: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


def compute(kv: KVCacheManager, req: Req) -> int:
    hit_ids, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit_ids)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return num_hit


def test_evict_blocks_leaves_holes_and_returns_blocks():
    kv = KVCacheManager(BS, 16)
    a = Req("a", list(range(24)))
    compute(kv, a)
    free_before = kv.pool.num_free_blocks
    freed = kv.evict_blocks("a", [1, 2])
    table = kv.block_table("a")
    assert table[1] == table[2] == HOLE and len(table) == 6 and kv.num_holes("a") == 2
    assert kv.pool.num_free_blocks == free_before and kv.num_free_blocks == 16 - 4  # parked: still cached
    kv.check_integrity()
    with pytest.raises(ValueError, match="already evicted"):
        kv.evict_blocks("a", [1])
    # Registered prompt blocks stay offered: their KV is what a fresh prefill stores.
    b = Req("b", list(range(24)) + [99])
    assert compute(kv, b) == 24 and set(freed) <= set(kv.block_table("b"))
    # After an eviction nothing new of "a" is registered: its later KV saw a partial context.
    a.output = list(range(100, 110))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    c = Req("c", a.all_token_ids + [1])
    assert compute(kv, c) == 24
    for r in (a, b, c):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_shared_block_evicted_by_one_holder_stays_for_the_other():
    kv = KVCacheManager(BS, 16)
    a, b = Req("a", list(range(17))), Req("b", list(range(17)))
    compute(kv, a)
    assert compute(kv, b) == 16
    shared = kv.block_table("b")[0]
    kv.evict_blocks("a", [0])
    assert kv.pool.ref_count(shared) == 1 and kv.block_table("b")[0] == shared
    kv.check_integrity()


def test_evictor_applies_policy_and_keeps_pool_integrity():
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=0.5)
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128)
    req = Req("a", list(range(40)))
    compute(kv, req)

    @dataclass
    class Chunk:
        request_id: str
        num_tokens: int

    mass = torch.tensor([[0.0, 5, 1, 9, 2, 0.5, 7, 3, 0, 0]])
    scores = [StepScores(["a"], torch.arange(10).unsqueeze(0), mass)]
    assert evictor.after_step([Chunk("a", 40)], scores, lambda rid: req) == 5
    assert [i for i, blk in enumerate(kv.block_table("a")) if blk != HOLE] == [0, 3, 6, 8, 9]
    kv.check_integrity()
    # Decoding on: the budget grows with the context, the scores keep accumulating.
    req.output = [1, 2, 3, 4]
    assert kv.allocate_slots(req, 4)
    req.num_computed_tokens = 44
    assert evictor.after_step([Chunk("a", 4)], [], lambda rid: req) == 0  # 6 live <= 6 kept
    evictor.forget(["a"])
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 32 and evictor.count.sum() == 0


@dataclass
class Chunk:
    request_id: str
    num_tokens: int


def step(kv: KVCacheManager, evictor: KVEvictor, req: Req, num_tokens: int, mass: list[float]) -> int:
    """Compute ``num_tokens`` more tokens of ``req`` whose observation gives ``mass`` to its live blocks."""
    assert kv.allocate_slots(req, num_tokens)
    req.num_computed_tokens += num_tokens
    live = [i for i, blk in enumerate(kv.block_table(req.request_id)) if blk != HOLE]
    assert len(live) == len(mass)
    scores = [StepScores([req.request_id], torch.tensor([live]), torch.tensor([mass]))]
    return evictor.after_step([Chunk(req.request_id, num_tokens)], scores, lambda rid: req)


def live_blocks(kv: KVCacheManager, request_id: str) -> list[int]:
    return [i for i, blk in enumerate(kv.block_table(request_id)) if blk != HOLE]


def test_heavy_hitter_prefill_keeps_the_prompt_budget_and_ranks_by_the_prompt_end():
    """A prompt prefilled in chunks drops only what exceeds the prompt's final budget; when it completes,
    its last queries (the question) pick the heavy hitters, not what earlier chunks attended to."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=0.5)  # 48 tokens -> keep 6 blocks: sink 0, recent 10, 11 (+9: half), 2 heavy
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128)
    req = Req("a", list(range(48)))
    # First chunk: the old rule (keep half of 24 tokens) dropped blocks 1, 2, 3 here.
    assert step(kv, evictor, req, 24, [0.4, 0.01, 0.01, 0.3, 0.01, 0.27]) == 0
    assert live_blocks(kv, "a") == list(range(6))
    assert evictor.peak_blocks(48, 24) >= 6 + 6  # what the scheduler admitted by still holds
    physical = kv.block_table("a")[:6]
    # Last chunk: its window attends to blocks 2 and 4 (a mean over both chunks would keep 3 and 5).
    mass = [0.3, 0.01, 0.2, 0.01, 0.2, 0.01, 0.01, 0.01, 0.01, 0.05, 0.1, 0.1]
    assert step(kv, evictor, req, 24, mass) == 6
    assert live_blocks(kv, "a") == [0, 2, 4, 9, 10, 11]
    table = kv.block_table("a")
    assert [table[i] for i in (0, 2, 4)] == [physical[i] for i in (0, 2, 4)]  # positions kept, no shift
    kv.check_integrity()


def test_heavy_hitter_scores_relative_to_uniform_not_stale_means():
    """A block attended to while the context was 3 blocks long must not outrank blocks that later queries
    attend to more than uniformly (the old mean per observation kept stale block 1 over block 6)."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=None, max_kv_tokens=24)  # keep 6 blocks
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128)
    req = Req("a", list(range(12)), output=list(range(28)))
    assert step(kv, evictor, req, 12, [0.5, 0.4, 0.1]) == 0  # the prompt: 3 blocks, nothing to drop
    # 28 tokens later (10 blocks): 0.15 and 0.14 are 1.5x / 1.4x uniform; block 1 gets nothing now.
    mass = [0.3, 0.0, 0.0, 0.01, 0.01, 0.15, 0.14, 0.01, 0.2, 0.18]
    assert step(kv, evictor, req, 28, mass) == 4
    assert live_blocks(kv, "a") == [0, 5, 6, 7, 8, 9]  # sink, heavy 5 and 6, recent 7 (half), 8, 9
    score = evictor.score(evictor._states["a"].row, 10)
    assert score[5] > score[1] > score[2]  # block 1's early score has decayed but is not forgotten
    kv.check_integrity()
