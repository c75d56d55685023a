"""KV cache manager: block tables, prefix hits, tenant isolation, eviction, and shards."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mcp2026.kv.manager import KVCacheManager

BS = 4


@dataclass
class Req:
    request_id: str
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    plan_id: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


def admit_and_compute(kv: KVCacheManager, req: Req) -> int:
    """Admit with prefix hits, compute the whole prompt at once, register full blocks; returns hit tokens."""
    hit_ids, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hit_ids)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    kv.check_integrity()
    return num_hit


def test_allocate_grows_the_table_block_by_block():
    kv = KVCacheManager(BS, 8)
    req = Req("a", list(range(5)))
    assert kv.allocate_slots(req, 5)
    assert kv.block_table("a") == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 3)  # positions 5..7 still fit block 1
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots(req, 4)
    assert len(kv.block_table("a")) == 3
    kv.check_integrity()


def test_failed_allocation_leaks_nothing():
    kv = KVCacheManager(BS, 4)
    a = Req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    b = Req("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity()


def test_prefix_hit_covers_full_blocks_but_never_the_last_token():
    kv = KVCacheManager(BS, 16)
    assert admit_and_compute(kv, Req("a", list(range(10)))) == 0
    assert admit_and_compute(kv, Req("b", list(range(10)) + [99])) == 8
    # Exactly two full blocks: the last token must be recomputed, so only one block hits.
    assert kv.get_computed_blocks(Req("c", list(range(8))))[1] == 4
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.cache.num_queries == 2 + 2 and kv.cache.num_hits == 2


def test_salts_and_plans_never_share_blocks():
    kv = KVCacheManager(BS, 32)
    prompt = list(range(9))
    admit_and_compute(kv, Req("a", prompt, cache_salt="tenant-a"))
    assert kv.get_computed_blocks(Req("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(Req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(Req("d", prompt, cache_salt="tenant-a", plan_id="int4"))[1] == 0
    assert kv.get_computed_blocks(Req("e", prompt, cache_salt="tenant-a"))[1] == 8


def test_hash_collisions_never_give_a_false_hit():
    kv = KVCacheManager(BS, 16, hash_fn=lambda parent, tokens, extra: b"collide")
    admit_and_compute(kv, Req("a", [1, 2, 3, 4, 5]))
    assert kv.get_computed_blocks(Req("b", [9, 9, 9, 9, 5]))[1] == 0
    assert admit_and_compute(kv, Req("c", [1, 2, 3, 4, 7])) == 4  # a true hit still works
    kv.check_integrity()


def test_freed_cached_blocks_are_evictable_and_reused_on_hit():
    kv = KVCacheManager(BS, 4)
    a = Req("a", list(range(9)))
    admit_and_compute(kv, a)
    table = kv.block_table("a")
    kv.free(a)
    assert kv.num_evictable_blocks == 2 and kv.pool.num_free_blocks == 2
    assert kv.num_free_blocks == 4
    b = Req("b", list(range(9)))
    assert admit_and_compute(kv, b) == 8
    assert kv.block_table("b")[:2] == table[:2]
    assert kv.num_evictable_blocks == 0


def test_allocation_evicts_cached_blocks_when_free_runs_out():
    kv = KVCacheManager(BS, 4)
    a = Req("a", list(range(9)))
    admit_and_compute(kv, a)
    kv.free(a)
    b = Req("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 16)
    assert kv.num_evictable_blocks == 0 and kv.cache.num_cached_blocks == 0
    kv.check_integrity()
    kv.free(b)
    assert kv.pool.num_free_blocks == 4


def test_revived_hits_are_counted_against_capacity():
    kv = KVCacheManager(BS, 3)
    a = Req("a", list(range(9)))
    admit_and_compute(kv, a)
    kv.free(a)  # blocks 0, 1 evictable, 3 blocks allocatable
    b = Req("b", list(range(8)) + list(range(50, 58)))
    hit_ids, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # Needs 4 blocks: 2 revived + 2 new, but only 3 exist.
    assert not kv.allocate_slots(b, b.num_tokens - num_hit, hit_ids)
    assert kv.num_evictable_blocks == 2
    kv.check_integrity()


def test_mark_uncacheable_blocks_registration_and_hits():
    kv = KVCacheManager(BS, 16)
    a = Req("a", list(range(9)))
    kv.mark_uncacheable("a")
    admit_and_compute(kv, a)
    assert kv.cache.num_cached_blocks == 0
    b = Req("b", list(range(9)))
    admit_and_compute(kv, b)
    kv.mark_uncacheable("b")  # late: already registered blocks are withdrawn
    assert kv.cache.num_cached_blocks == 0
    assert kv.get_computed_blocks(Req("c", list(range(9))))[1] == 0
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 16
    kv.check_integrity()


def test_prefix_caching_disabled():
    kv = KVCacheManager(BS, 16, enable_prefix_caching=False)
    admit_and_compute(kv, Req("a", list(range(9))))
    assert admit_and_compute(kv, Req("b", list(range(9)))) == 0
    assert kv.cache.num_cached_blocks == 0


def test_release_shards_drops_offline_cache_and_reports_holders():
    kv = KVCacheManager(BS, 8, num_shards=2)
    a = Req("a", list(range(9)))  # blocks 0..2
    admit_and_compute(kv, a)
    kv.free(a)  # 0, 1 evictable, 2 free
    b = Req("b", list(range(100, 121)))  # 6 blocks: the free 2, 3 in shard 0, then all of shard 1
    assert kv.allocate_slots(b, b.num_tokens)
    assert kv.block_table("b") == [2, 3, 4, 5, 6, 7]
    c = Req("c", list(range(200, 204)))
    used = kv.release_shards(1)
    assert used == [4, 5, 6, 7] and kv.request_ids_holding(used) == ["b"]
    assert kv.request_ids_holding([0]) == []
    kv.free(b, preempted=True)
    kv.check_integrity()
    assert kv.num_free_blocks == 4 and kv.num_online_blocks == 4
    assert kv.allocate_slots(c, 4)
    kv.grow_shards(1)
    assert kv.num_free_blocks == 7
    kv.check_integrity()


def test_parked_blocks_in_released_shards_are_evicted():
    kv = KVCacheManager(BS, 4, num_shards=2)
    a = Req("a", list(range(13)))
    admit_and_compute(kv, a)  # blocks 0..3, three full cached
    kv.free(a)
    assert kv.num_evictable_blocks == 3
    assert kv.release_shards(1) == []
    assert kv.num_evictable_blocks == 2 and kv.num_free_blocks == 2
    kv.check_integrity()
    assert kv.get_computed_blocks(Req("b", list(range(13))))[1] == 8


def test_stale_hits_are_rejected():
    kv = KVCacheManager(BS, 4)
    a = Req("a", list(range(9)))
    admit_and_compute(kv, a)
    kv.free(a)
    b = Req("b", list(range(9)))
    hit_ids, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(Req("x", list(range(100, 116))), 16)  # evicts everything
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots(b, 1, hit_ids)


def test_only_full_computed_blocks_are_registered():
    kv = KVCacheManager(BS, 16)
    a = Req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 7  # the last token of block 1 has no KV yet
    kv.cache_full_blocks(a)
    assert kv.cache.num_cached_blocks == 1
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    assert kv.cache.num_cached_blocks == 2


def test_parked_blocks_past_the_cap_go_back_to_be_reused_first():
    """Finished prompts stay cached only up to the cap; the rest return to the free list, whose freshly freed
    blocks are handed out next, so a server keeps writing the same blocks instead of every block of its pool."""
    kv = KVCacheManager(BS, 32, max_parked_blocks=2)
    a = Req("a", list(range(17)))  # 4 full blocks + 1
    admit_and_compute(kv, a)
    first = kv.block_table("a")
    kv.free(a)
    assert kv.num_evictable_blocks == 2 and kv.pool.num_parked_blocks == 2
    kv.check_integrity()
    b = Req("b", list(range(100, 109)))
    admit_and_compute(kv, b)
    assert set(kv.block_table("b")) <= set(first)  # reused, no fresh block touched
    kv.check_integrity()
