"""Eviction: budgets, which blocks each policy drops in each lane, slot compaction in the manager, pool
integrity, the prefix rule."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch

from mcp2026.kv.eviction import BlockView, EvictionBudget, StepScores, make_policy
from mcp2026.kv.evictor import KVEvictor
from mcp2026.kv.manager import KVCacheManager

BS = 4


def budget(**kw) -> EvictionBudget:
    args = dict(block_size=BS, num_sink_tokens=4, recent_window=8, sparsity_ratio=0.5, max_kv_tokens=None)
    args.update(kw)
    return EvictionBudget(**args)


def view(b: EvictionBudget, num_tokens: int, score=None, origin=None) -> BlockView:
    """Lanes = rows of ``score`` (one lane when it is 1-D); ``origin``: the block each slot holds."""
    nb = -(-num_tokens // BS)
    score = torch.zeros(1, nb) if score is None else torch.tensor(score, dtype=torch.float32)
    score = score if score.dim() == 2 else score.unsqueeze(0)
    origin = torch.arange(nb) if origin is None else torch.tensor(origin)
    origin = origin.expand(score.shape[0], -1) if origin.dim() == 1 else origin
    return BlockView(
        num_tokens=num_tokens,
        origin=origin,
        is_sink=origin < b.num_sink_blocks(),
        is_recent=origin >= b.first_recent_block(num_tokens),
        score=score,
        num_keep=b.num_keep_blocks(num_tokens),
    )


def dropped(mask: torch.Tensor) -> list:
    """Dropped slots per lane (one lane: a flat list)."""
    rows = [row.nonzero().squeeze(1).tolist() for row in mask]
    return rows[0] if len(rows) == 1 else rows


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
    assert dropped(chosen) == [1, 2, 3, 4, 5]  # keeps block 0 (sink), 6, 7 (older budget) and 8, 9 (recent)


def test_heavy_hitter_keeps_high_scores_and_protects_sink_and_recent():
    b = budget()
    score = [0.0, 5, 1, 9, 2, 0.5, 7, 3, 0, 0]
    chosen = make_policy("heavy_hitter", b).select(view(b, 40, score))
    # keeps sink 0, recent 8 and 9, the hottest 3 and the block after it (what 3 holds may end in 4)
    assert dropped(chosen) == [1, 2, 5, 6, 7]


def test_a_heavy_blocks_successor_ranks_right_after_it():
    """A block that follows a heavy one (consecutive positions, not after a sink) ranks just below it: a
    fact cut by a block boundary is kept whole, and when only one of the two fits, the attended one stays."""
    b = budget(sparsity_ratio=0.3)  # 40 tokens: keep 7 blocks = sink 0 + recent 8, 9 + 4 flexible
    far = [9.0, 0, 4, 0, 0, 0.01, 0.02, 0.1, 1, 1]  # block 1 follows the sink: it inherits nothing
    policy = make_policy("heavy_hitter", b)
    assert policy.heavy_slots(view(b, 40, far)).tolist() == [3]
    assert dropped(policy.select(view(b, 40, far))) == [1, 4, 5]  # keeps 7 (newest), 2, 3 (after 2), 6
    # Block 3 already gone: slot 3 holds block 4, which does not follow block 2 and inherits nothing.
    origin = [0, 1, 2, 4, 5, 6, 7, 8, 9]
    score = [9.0, 0, 4, 0, 0.01, 0.02, 0.1, 1, 1]  # 9 slots, keep 7: drops blocks 1 and 4, not 5
    assert dropped(policy.select(view(b, 40, score, origin))) == [1, 3]
    # Only one of a heavy block and its successor fits: the heavy one stays.
    snap = make_policy("snap", budget(sparsity_ratio=0.6))  # 40 tokens: keep sink 0, recent 8, 9 + 1
    assert dropped(snap.select(view(snap.budget, 40, [0.0, 0, 0, 5, 0, 0, 0, 0, 0, 0]))) == [1, 2, 4, 5, 6, 7]
    # snap follows the rule too: 2 flexible slots go to block 3 and its successor 4, not to block 6
    snap = make_policy("snap", budget(sparsity_ratio=0.5))
    assert dropped(snap.select(view(snap.budget, 40, [0.0, 0, 0, 5, 0, 0, 1, 0, 0, 0]))) == [1, 2, 5, 6, 7]


def test_heavy_hitter_chooses_per_lane_over_compacted_slots():
    """Two lanes that already dropped different blocks (slots hold other blocks in each) keep their own
    heavy hitters; every lane drops the same number of slots."""
    b = budget()
    origin = [[0, 2, 3, 5, 6, 7, 8, 9], [0, 1, 4, 5, 6, 7, 8, 9]]  # 8 slots, 40 tokens: keep 5
    score = [[0, 0, 3, 1, 2, 4, 0, 0], [0, 5, 0, 1, 0, 3, 0, 0]]
    chosen = make_policy("heavy_hitter", b).select(view(b, 40, score, origin))
    # each lane keeps sink 0, recent 8 and 9, and its own two hottest: blocks 3 and 7, blocks 1 and 7
    assert dropped(chosen) == [[1, 3, 4], [2, 3, 4]]


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
    assert dropped(chosen) == [1, 2]  # left edge = block 3, the oldest with heat >= 0.6 x 2.0
    capped = budget(sparsity_ratio=0.5)  # keep 4 blocks: the oldest of the window go too
    chosen = make_policy("dynamic_window", capped).select(view(capped, 32, score))
    assert dropped(chosen) == [1, 2, 3, 4]
    # Two lanes: the second is hot from block 2 on; both drop what every lane finds cold (block 1).
    two = [score, [9.0, 0.1, 1.5, 1.3, 0.2, 0.1, 2.0, 2.0]]
    assert dropped(make_policy("dynamic_window", b).select(view(b, 32, two))) == [[1], [1]]


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
    def prompt_token_ids(self) -> list[int]:
        return self.prompt

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


def test_drop_slots_frees_the_tail_and_keeps_registered_blocks_as_hits():
    kv = KVCacheManager(BS, 16)
    a = Req("a", list(range(24)))
    compute(kv, a)  # 6 blocks, all registered
    before = kv.block_table("a")
    tables = kv.drop_slots("a", 6, 2, 1)  # slots 1.. are rewritten (the lanes keep slots 2..5 there)
    assert tables is not None and tables[0] == before
    after = tables[1]
    assert len(after) == 4 and after[0] == before[0] and kv.num_dropped_tokens("a") == 8
    # Registered blocks about to be rewritten moved to fresh blocks: the originals keep their bytes and
    # stay prefix hits (parked: nobody holds them); the two vacated slots' blocks too.
    assert not set(after[1:]) & set(before) and kv.num_free_blocks == 16 - 4
    kv.check_integrity()
    b = Req("b", list(range(24)) + [99])
    assert compute(kv, b) == 24 and kv.block_table("b")[:6] == before
    # After an eviction nothing new of "a" is registered: its later KV saw a partial context.
    a.output = list(range(100, 110))
    assert kv.allocate_slots(a, 10)
    assert len(kv.block_table("a")) == -(-(34 - 8) // BS)  # the table covers the kept tokens
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    c = Req("c", a.all_token_ids + [1])
    assert compute(kv, c) == 24
    for r in (a, b, c):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 16 and kv.num_dropped_tokens("a") == 0
    compute(kv, Req("d", list(range(24))))
    with pytest.raises(ValueError, match="cannot drop"):
        kv.drop_slots("d", 6, 6, 1)  # slot 0 is not rewritten, so at most 5 can go


def test_privatize_then_release_slots():
    """Per-layer budgets may write any block of a request: every shared block moves to a fresh copy, registered
    ones too while blocks are spare (the originals stay prefix hits); then any table entries can be released."""
    kv = KVCacheManager(BS, 16, enable_prefix_caching=True)
    a, b = Req("a", list(range(17))), Req("b", list(range(17)))
    compute(kv, a)
    assert compute(kv, b) == 16
    shared = kv.block_table("b")[:4]
    tables = kv.privatize("a")
    assert tables is not None and tables[0][:4] == shared
    assert not set(tables[1]) & set(shared) and kv.block_table("b")[:4] == shared
    assert all(kv.pool.ref_count(x) == 1 for x in shared)
    kv.check_integrity()
    kv.release_slots("a", [1, 3])
    assert kv.block_table("a") == [tables[1][i] for i in (0, 2, 4)] and kv.num_dropped_tokens("a") == 8
    kv.check_integrity()
    assert compute(kv, Req("c", list(range(17)))) == 16  # the originals are still hits
    with pytest.raises(ValueError, match="no table entries"):
        kv.release_slots("a", [3])
    # No block to copy a shared one into: nothing changes.
    full = KVCacheManager(BS, 6)
    a2, b2 = Req("a", list(range(17))), Req("b", list(range(16)) + [7])
    compute(full, a2)
    assert compute(full, b2) == 16 and full.num_free_blocks == 0
    assert full.privatize("a") is None and full.block_table("a")[:4] == full.block_table("b")[:4]
    full.check_integrity()


def test_drop_slots_never_rewrites_a_block_another_request_holds():
    kv = KVCacheManager(BS, 16, enable_prefix_caching=True)
    a, b = Req("a", list(range(17))), Req("b", list(range(17)))
    compute(kv, a)
    assert compute(kv, b) == 16
    shared = kv.block_table("b")[:4]
    tables = kv.drop_slots("a", 5, 1, 0)
    assert tables is not None and not set(tables[1][:4]) & set(shared)  # "a" writes into its own copies
    assert kv.block_table("b")[:4] == shared and all(kv.pool.ref_count(x) == 1 for x in shared)
    kv.check_integrity()
    # No block to copy into: nothing changes.
    full = KVCacheManager(BS, 6)
    a2, b2 = Req("a", list(range(17))), Req("b", list(range(16)) + [7])
    compute(full, a2)
    assert compute(full, b2) == 16 and full.num_free_blocks == 0
    assert full.drop_slots("a", 5, 1, 0) is None and len(full.block_table("a")) == 5
    full.check_integrity()


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

    mass = torch.tensor([[[0.0, 5, 1, 9, 2, 0.5, 7, 3, 0, 0]]])
    scores = [StepScores(["a"], [10], mass)]
    assert evictor.after_step([Chunk("a", 40)], scores, lambda rid: req) == 5
    assert evictor.origins("a", 5).tolist() == [[0, 3, 4, 8, 9]] and len(kv.block_table("a")) == 5
    kv.check_integrity()
    # Decoding on: the budget grows with the context, the scores keep accumulating.
    req.output = [1, 2, 3, 4]
    assert kv.allocate_slots(req, 4)
    req.num_computed_tokens = 44
    assert evictor.after_step([Chunk("a", 4)], [], lambda rid: req) == 0  # 6 live <= 6 kept
    assert evictor.origins("a", 6).tolist() == [[0, 3, 4, 8, 9, 10]]  # the new slot holds block 10
    evictor.forget(["a"])
    kv.free(req)
    kv.check_integrity()
    assert kv.num_free_blocks == 32 and evictor.scores.count.sum() == 0


@dataclass
class Chunk:
    request_id: str
    num_tokens: int


def step(kv: KVCacheManager, evictor: KVEvictor, req: Req, num_tokens: int, mass: list[float]) -> int:
    """Compute ``num_tokens`` more tokens of ``req`` whose observation gives ``mass`` to its live blocks."""
    assert kv.allocate_slots(req, num_tokens)
    req.num_computed_tokens += num_tokens
    num_slots = -(-(req.num_computed_tokens - kv.num_dropped_tokens(req.request_id)) // BS)
    assert num_slots == len(mass)
    scores = [StepScores([req.request_id], [num_slots], torch.tensor([[mass]]))]
    return evictor.after_step([Chunk(req.request_id, num_tokens)], scores, lambda rid: req)


def live_blocks(kv: KVCacheManager, evictor: KVEvictor, request_id: str) -> list[int]:
    """The blocks the request's slots hold (one lane)."""
    return evictor.origins(request_id, len(kv.block_table(request_id)))[0].tolist()


def test_heavy_hitter_prefill_keeps_the_prompt_budget_and_ranks_by_the_prompt_end():
    """A prompt prefilled in chunks drops only what exceeds the prompt's final budget; when it completes,
    its last queries (the question) pick the heavy hitters, not what earlier chunks attended to."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=0.5)  # 48 tokens -> keep 6 blocks: sink 0, recent 10, 11 (+9: half), 2 heavy
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128)
    req = Req("a", list(range(48)))
    # First chunk: the old rule (keep half of 24 tokens) dropped blocks 1, 2, 3 here.
    assert step(kv, evictor, req, 24, [0.4, 0.01, 0.01, 0.3, 0.01, 0.27]) == 0
    assert live_blocks(kv, evictor, "a") == list(range(6))
    assert evictor.peak_blocks(48, 24) >= 6 + 6  # what the scheduler admitted by still holds
    physical = kv.block_table("a")[:6]
    # Last chunk: its window attends to blocks 2 and 4 (a mean over both chunks would keep 3 and 5).
    mass = [0.3, 0.01, 0.2, 0.01, 0.2, 0.01, 0.01, 0.01, 0.01, 0.05, 0.1, 0.1]
    assert step(kv, evictor, req, 24, mass) == 6
    assert live_blocks(kv, evictor, "a") == [0, 2, 4, 5, 10, 11]  # 5: 4's successor (3 ties, older: dropped)
    assert kv.block_table("a")[:1] == physical[:1]  # slots before the first dropped one are not moved
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
    assert live_blocks(kv, evictor, "a") == [0, 5, 6, 7, 8, 9]  # sink, heavy 5 and 6, recent 7 (half), 8, 9
    score = evictor.scores.recent[
        evictor._states["a"].row, 0, :10
    ]  # compacted with the slots: blocks 0, 5, 6, ...
    assert (
        score[1] > 1.0 and score[2] > 1.0 and float(score[6:].abs().sum()) == 0
    )  # above uniform; rest zeroed
    kv.check_integrity()


@pytest.mark.parametrize(("pool_blocks", "streams"), [(32, False), (20, True)])
def test_heavy_hitter_keeps_a_prompt_that_fits_whole_until_its_end(pool_blocks, streams):
    """A 96-token prompt (24 blocks, final budget 12) in 32-token chunks: kept whole when the pool could hold
    it (the question at its end ranks every block); streamed, dropping what exceeds 12, when it could not."""
    kv = KVCacheManager(BS, pool_blocks)
    evictor = KVEvictor(make_policy("heavy_hitter", budget(sparsity_ratio=0.5)), kv, max_model_len=128)
    req = Req("a", list(range(96)))
    assert evictor.peak_blocks(96, 32) == (12 + 8 + 1 if streams else 24)
    assert step(kv, evictor, req, 32, [1.0 / 8] * 8) == 0
    assert step(kv, evictor, req, 32, [1.0 / 16] * 16) == (4 if streams else 0)
    num_live = 20 if streams else 24
    mass = [1.0 / num_live] * num_live
    assert step(kv, evictor, req, 32, mass) == (8 if streams else 12)
    assert len(kv.block_table("a")) == 12
    kv.check_integrity()


def test_heavy_hitter_splits_each_lanes_budget_by_how_far_it_attends():
    """A lane whose attention stays local keeps a window; a lane that reaches back keeps what it reaches for,
    with the share of its budget that a window would lose of its attention."""
    b = budget(sparsity_ratio=0.3)  # 40 tokens: keep 7 blocks = sink 0 + recent 8, 9 + 4 flexible
    local = [1.0, 0, 0, 0, 0, 0.01, 0.02, 1, 2, 3]  # nothing on blocks 1-3 (what a window drops)
    far = [1.0, 0, 4, 0, 0, 0.01, 0.02, 0.1, 1, 1]  # 4 of its 6.13 non-sink mass on block 2: 65%
    policy = make_policy("heavy_hitter", b)
    assert policy.heavy_slots(view(b, 40, [local, far])).tolist() == [0, 3]  # floor(0.65 x 6 blocks)
    # local: the window (4-7); far: the newest block 7, then its hottest candidate 2, 2's successor 3, and 6
    assert dropped(policy.select(view(b, 40, [local, far]))) == [[1, 2, 3], [1, 4, 5]]
    capped = make_policy("heavy_hitter", dataclasses.replace(b, max_heavy_share=0.0))
    assert dropped(capped.select(view(b, 40, [local, far]))) == [[1, 2, 3], [1, 2, 3]]  # sink_window's


def test_recent_scores_decay_with_age_and_start_from_the_first_observation():
    kv = KVCacheManager(BS, 32)
    evictor = KVEvictor(make_policy("heavy_hitter", budget()), kv, max_model_len=128, num_lanes=2)
    first = torch.tensor([[[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]]])  # (1 request, 2 lanes, 3 slots)
    evictor.absorb([StepScores(["a"], [3], first)], {"a": 12})
    row = evictor._states["a"].row
    torch.testing.assert_close(
        evictor.scores.recent[row, :, :3], first[0] * 3
    )  # relative to uniform (x 3 slots)
    second = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    half_life = int(evictor.policy.score_half_life)
    evictor.absorb([StepScores(["a"], [3], second)], {"a": half_life})  # one half-life later: equal weights
    torch.testing.assert_close(evictor.scores.recent[row, :, :3], (first[0] + second[0]) * 1.5)
    torch.testing.assert_close(evictor.scores.last[row, :, :3], second[0] * 3)


def test_lexical_anchors_find_the_passage_the_question_names():
    from mcp2026.kv.eviction import lexical_anchors

    filler = [1000 + i for i in range(48)]
    ids = filler[:12] + [7, 8, 9, 10] + filler[16:40] + [5, 7, 6, 8, 5, 5, 5, 5]  # the question: last 8
    assert lexical_anchors(ids, BS, 8, 1) == [(3, 4)]  # block 3 shares 7 and 8 with it; + the block after
    assert lexical_anchors(ids, BS, 8, 1, first_block=4) == []  # before first_block: not a candidate
    assert lexical_anchors(filler, BS, 8, 1) == []  # nothing shared
    common = [t if i % 4 else 5 for i, t in enumerate(ids)]  # token 5 opens every block: weight log(1) = 0
    common[12:16] = [5, 1, 2, 3]
    assert lexical_anchors(common, BS, 8, 1) == []
    two = ids[:24] + [6, 0, 0, 0] + ids[28:]
    assert lexical_anchors(two, BS, 8, 2) == [(3, 4), (6, 7)]  # two passages, best first, with successors


@pytest.mark.parametrize("num_anchors", [1, 0])
def test_heavy_hitter_keeps_the_questions_passage_in_every_lane(num_anchors):
    """Both lanes ignore block 3 when the prompt completes (the copying lanes of a 135M model do), but the
    question shares rare tokens with it: it and its successor stay in every lane for ``anchor_tokens`` more
    tokens; then they are candidates like any block (here: equal scores, so the oldest, they go first)."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=0.3, observation_window=8, num_anchors=num_anchors, anchor_tokens=12)
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128, num_lanes=2)
    filler = [1000 + i for i in range(48)]
    req = Req("a", filler[:12] + [7, 8, 9, 10] + filler[16:40] + [5, 7, 6, 8, 5, 5, 5, 5], output=[1] * 32)
    mass = torch.full((1, 2, 12), 0.1)
    mass[0, :, 3:5] = 0.0
    assert kv.allocate_slots(req, 48)
    req.num_computed_tokens = 48  # keep 34 tokens: 9 blocks = sink, recent 10-11, 6 flexible
    # heavy_hitter holds live anchors on top of its budget: 1 slot dropped with them, 3 without
    assert evictor.after_step([Chunk("a", 48)], [StepScores(["a"], [12], mass)], lambda rid: req) == (
        1 if num_anchors else 3
    )
    assert evictor.report()["num_anchor_blocks"] == 2 * num_anchors

    def anchored() -> list[bool]:
        kept = evictor.origins("a", len(kv.block_table("a")))
        return [bool((kept == a).any(1).all()) for a in (3, 4)]

    assert anchored() == [bool(num_anchors)] * 2
    for num_tokens in (52, 56, 60, 64, 68, 72):  # equal scores: the oldest candidates go first
        assert kv.allocate_slots(req, 4)
        req.num_computed_tokens = num_tokens
        n = len(kv.block_table("a"))
        scores = [StepScores(["a"], [n], torch.full((1, 2, n), 0.1))]
        evictor.after_step([Chunk("a", 4)], scores, lambda rid: req)
        if num_tokens < 48 + 12:
            assert anchored() == [bool(num_anchors)] * 2, num_tokens
    assert anchored()[0] is False  # expired: the oldest candidate went at the next eviction (68)
    kv.check_integrity()


@pytest.mark.parametrize(("policy", "sparsity", "kept"), [("heavy_hitter", 0.3, [3, 4]), ("heavy_hitter", 0.55, []),
                                                     ("snap", 0.3, [3, 4])])  # fmt: skip
def test_anchors_fit_in_half_the_flexible_budget_best_passage_first(policy, sparsity, kept):
    """Two passages named (blocks 3-4 share two tokens with the question, 6-7 one): at 30% dropped the 6
    flexible slots leave room for one passage (3 slots), the best; at 55% (3 flexible, room 1) for none, and the
    policy's own ranking drops them; snap protects them in its one eviction."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=sparsity, observation_window=8, num_anchors=2)
    evictor = KVEvictor(make_policy(policy, b), kv, max_model_len=128, num_lanes=2)
    filler = [1000 + i for i in range(48)]
    ids = (
        filler[:12] + [7, 8, 9, 10] + filler[16:24] + [6, 0, 0, 0] + filler[28:40] + [5, 7, 6, 8, 5, 5, 5, 5]
    )
    req = Req("a", ids)
    mass = torch.full((1, 2, 12), 0.1)
    mass[0, :, 3:8] = 0.0  # nothing attends to either passage
    assert kv.allocate_slots(req, 48)
    req.num_computed_tokens = 48
    assert evictor.after_step([Chunk("a", 48)], [StepScores(["a"], [12], mass)], lambda rid: req) > 0
    held = evictor.origins("a", len(kv.block_table("a")))
    assert evictor.report()["num_anchor_blocks"] == len(kept)  # the passages anchored ...
    assert all(bool((held == a).any(1).all()) for a in kept)  # ... and held in every lane
    if policy == "snap" or not kept:  # anchors out of the budget: the other passage's blocks went
        assert [a for a in range(3, 8) if bool((held == a).any(1).all())] == kept
    kv.check_integrity()


def test_a_streamed_prompt_anchors_only_what_every_lane_still_holds():
    """A 96-token prompt streams through a 20-block pool: lane 0 drops block 3 (the question's passage) in the
    second chunk, lane 1 keeps it. At the prompt's end the passage is no anchor (an anchor must sit in every
    lane, or lanes would hold different numbers of protected slots), and the pool stays whole."""
    kv = KVCacheManager(BS, 20)
    b = budget(sparsity_ratio=0.5, observation_window=8, num_anchors=1)
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128, num_lanes=2)
    filler = [1000 + i for i in range(96)]
    req = Req("a", filler[:12] + [7, 8, 9, 10] + filler[16:88] + [5, 7, 6, 8, 5, 5, 5, 5])
    assert evictor.peak_blocks(96, 32) < 24  # it streams

    def chunk(num_slots: int, lane0_on_3: float) -> int:
        assert kv.allocate_slots(req, 32)
        req.num_computed_tokens += 32
        mass = torch.full((1, 2, num_slots), 1.0 / num_slots)
        mass[0, 0, 3], mass[0, 1, 3] = lane0_on_3, 1.0
        return evictor.after_step([Chunk("a", 32)], [StepScores(["a"], [num_slots], mass)], lambda rid: req)

    assert chunk(8, 0.0) == 0
    assert chunk(16, 0.0) == 4
    held = evictor.origins("a", 12)
    assert not bool((held[0] == 3).any()) and bool((held[1] == 3).any())
    assert chunk(20, 0.0) > 0  # the prompt's end: ranked, no anchors
    assert evictor.report()["num_anchor_blocks"] == 0
    kv.check_integrity()


@pytest.mark.parametrize("policy", ["heavy_hitter", "snap"])
@pytest.mark.parametrize("looks", [True, False])
def test_draft_attention_joins_the_prompts_ranking(policy, looks):
    """The prompt's last queries ignore block 5 in both lanes; the draft's queries attend to it in lane 1
    (the lane that copies from it). With lookahead, lane 1 keeps it and lane 0 does not; without, neither.
    The hook runs once, when the prompt completes, for that request."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=0.5, observation_window=8, num_anchors=0, lookahead_tokens=4 if looks else 0)
    evictor = KVEvictor(make_policy(policy, b), kv, max_model_len=128, num_lanes=2)
    req = Req("a", [1000 + i for i in range(48)], output=[1] * 8)
    calls = []

    def lookahead(requests, num_tokens):
        calls.append(([r.request_id for r in requests], num_tokens))
        draft = torch.ones(2, 12)
        draft[1, 5] = 40.0  # relative to uniform
        return {"a": draft}

    mass = torch.full((1, 2, 12), 0.1)
    mass[0, :, 5] = 0.0
    assert kv.allocate_slots(req, 48)
    req.num_computed_tokens = 48
    assert (
        evictor.after_step([Chunk("a", 48)], [StepScores(["a"], [12], mass)], lambda rid: req, lookahead) > 0
    )
    held = evictor.origins("a", len(kv.block_table("a")))
    assert [bool((held[lane] == 5).any()) for lane in (0, 1)] == [False, looks]
    assert calls == ([(["a"], 4)] if looks else [])
    assert evictor.report()["num_lookahead_drafts"] == int(looks)
    assert kv.allocate_slots(req, 4)  # a decode step: no second draft
    req.num_computed_tokens = 52
    n = len(kv.block_table("a"))
    evictor.after_step(
        [Chunk("a", 4)], [StepScores(["a"], [n], torch.full((1, 2, n), 0.1))], lambda r: req, lookahead
    )
    assert len(calls) == int(looks)
    kv.check_integrity()


def test_anchors_over_the_budget_leave_each_lanes_split_as_it_was():
    """A lane that attends to the anchored passage (blocks 2-3) and to blocks 5-6 far back keeps all of its
    flexible budget for heavy hitters when the passage is anchored on top of it: its reach is judged as if
    nothing were anchored. Judged with the anchors taken out of the candidates, it looked local (1 heavy slot)
    and traded 5 and 6 for a window (8, 9)."""
    b = budget(sparsity_ratio=None, max_kv_tokens=6 * BS, recent_window=2 * BS)  # 12 blocks, keep 6
    score = [0.0, 0.1, 5.0, 5.0, 0.1, 2.0, 2.0, 0.1, 0.1, 0.1, 1.0, 1.0]
    plain = view(b, 12 * BS, score)
    policy = make_policy("heavy_hitter", b)
    assert dropped(policy.select(plain)) == [1, 5, 6, 7, 8, 9]  # heavy: 2, 3 and 3's successor 4
    anchored = dataclasses.replace(
        plain,
        is_anchor=torch.isin(plain.origin, torch.tensor([2, 3])),
        num_keep=plain.num_keep + 2,
        num_over_budget=2,
    )
    assert policy.heavy_slots(anchored).tolist() == [1]  # the reach with the anchors taken out
    assert dropped(policy.select(anchored)) == [1, 7, 8, 9]  # anchors on top; heavy 4, 5, 6


def test_a_failed_draft_leaves_the_prompts_own_ranking(caplog):
    """Drafts only refine the ranking: if they fail, the step still evicts, by the question's attention."""
    kv = KVCacheManager(BS, 32)
    b = budget(sparsity_ratio=0.5, observation_window=8, num_anchors=0, lookahead_tokens=4)
    evictor = KVEvictor(make_policy("heavy_hitter", b), kv, max_model_len=128, num_lanes=2)
    req = Req("a", [1000 + i for i in range(48)], output=[1] * 8)

    def broken(requests, num_tokens):
        raise RuntimeError("draft failed")

    assert kv.allocate_slots(req, 48)
    req.num_computed_tokens = 48
    mass = torch.full((1, 2, 12), 0.1)
    assert evictor.after_step([Chunk("a", 48)], [StepScores(["a"], [12], mass)], lambda rid: req, broken) > 0
    assert "lookahead drafts failed" in caplog.text and evictor.report()["num_lookahead_drafts"] == 0
    kv.check_integrity()
