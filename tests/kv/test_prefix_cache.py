"""Prefix cache: stable chained keys, exact verification, LRU-2 eviction order."""

from __future__ import annotations

from mcp2026.kv.prefix_cache import PrefixCache, hash_block

EXTRA = (None, None)


def test_hash_is_pinned_and_covers_every_input():
    # Fixed across processes and versions (unlike Python's salted hash()): persisted caches rely on it.
    assert hash_block(None, [0, 1], EXTRA).hex() == "8b39dcb1e0ea95837646238d0160504f"
    assert hash_block(None, [1, 2, 3, 4], ("tenant-a", "plan")).hex() == "411ee55d87912fe05526b992d5392474"
    key = hash_block(None, [1, 2, 3, 4], EXTRA)
    variants = {
        key,
        hash_block(key, [1, 2, 3, 4], EXTRA),
        hash_block(None, [1, 2, 3, 5], EXTRA),
        hash_block(None, [1, 2, 3, 4], ("tenant-a", None)),
        hash_block(None, [1, 2, 3, 4], ("tenant-b", None)),
        hash_block(None, [1, 2, 3, 4], (None, "plan-int4")),
        hash_block(None, [1, 2, 3, 4], ("", None)),
    }
    assert len(variants) == 7


def test_lookup_follows_the_chain_and_verifies_tokens():
    cache = PrefixCache()
    k0 = cache.key(None, [1, 2], EXTRA)
    e0 = cache.insert(k0, 10, None, [1, 2], EXTRA)
    k1 = cache.key(k0, [3, 4], EXTRA)
    e1 = cache.insert(k1, 11, e0, [3, 4], EXTRA)
    assert cache.lookup(k0, None, [1, 2], EXTRA) is e0
    assert cache.lookup(k1, e0, [3, 4], EXTRA) is e1
    assert cache.lookup(k1, None, [3, 4], EXTRA) is None  # wrong parent
    assert cache.lookup(k0, None, [1, 2], ("salt", None)) is None  # wrong tenant
    assert e1.depth == 1


def test_hash_collision_is_a_miss_not_a_false_hit():
    cache = PrefixCache(hash_fn=lambda parent, tokens, extra: b"same")
    e = cache.insert(cache.key(None, [1, 2], EXTRA), 0, None, [1, 2], EXTRA)
    key = cache.key(None, [7, 8], EXTRA)
    assert key == e.key
    assert cache.lookup(key, None, [7, 8], EXTRA) is None
    assert cache.insert(key, 1, None, [7, 8], EXTRA) is None  # collision: not cached
    assert cache.entry_of(1) is None
    cache.check_integrity()


def test_recycled_parent_block_does_not_validate_stale_children():
    cache = PrefixCache()
    k0 = cache.key(None, [1], EXTRA)
    e0 = cache.insert(k0, 5, None, [1], EXTRA)
    cache.insert(cache.key(k0, [2], EXTRA), 6, e0, [2], EXTRA)
    cache.set_evictable(5)
    assert cache.pop_evictable() == 5
    # Same content re-cached in the same block id: a new uid, so the old child no longer verifies.
    e0b = cache.insert(k0, 5, None, [1], EXTRA)
    assert cache.lookup(cache.key(k0, [2], EXTRA), e0b, [2], EXTRA) is None


def test_duplicate_content_returns_the_existing_entry():
    cache = PrefixCache()
    key = cache.key(None, [1, 2], EXTRA)
    e = cache.insert(key, 0, None, [1, 2], EXTRA)
    assert cache.insert(key, 1, None, [1, 2], EXTRA) is e
    assert cache.entry_of(1) is None and cache.num_cached_blocks == 1


def _cache_with_blocks(n: int) -> PrefixCache:
    cache = PrefixCache()
    for b in range(n):
        cache.insert(cache.key(None, [b], EXTRA), b, None, [b], EXTRA)  # access at clock b+1
    return cache


def test_lru2_evicts_single_access_first_then_oldest_second_access():
    cache = _cache_with_blocks(3)  # A=0 (t1), B=1 (t2), C=2 (t3)
    cache.touch([2])  # C: t3, t4
    cache.touch([0])  # A: t1, t5
    for b in range(3):
        cache.set_evictable(b)
    # B was seen once (second access -inf); A's second-latest access (t1) is older than C's (t3).
    assert [cache.pop_evictable() for _ in range(4)] == [1, 0, 2, None]


def test_lru2_ties_go_to_oldest_last_access_then_deepest_block():
    cache = _cache_with_blocks(2)
    cache.set_evictable(1)
    cache.set_evictable(0)
    assert cache.pop_evictable() == 0  # both seen once: older last access first
    chain = PrefixCache()
    k0 = chain.key(None, [1], EXTRA)
    e0 = chain.insert(k0, 0, None, [1], EXTRA)
    chain.insert(chain.key(k0, [2], EXTRA), 1, e0, [2], EXTRA)
    chain.touch([0, 1])
    chain.touch([0, 1])
    chain.set_evictable(0)
    chain.set_evictable(1)
    assert chain.pop_evictable() == 1  # same access times: the tail of the sequence goes first


def test_in_use_blocks_are_not_evicted():
    cache = _cache_with_blocks(2)
    cache.set_evictable(0)
    cache.set_evictable(1)
    cache.set_in_use(0)
    assert cache.num_evictable == 1
    assert cache.pop_evictable() == 1
    assert cache.pop_evictable() is None
    assert cache.entry_of(0) is not None
    cache.check_integrity()


def test_touching_an_evictable_block_reorders_it():
    cache = _cache_with_blocks(2)
    cache.touch([0])
    cache.touch([1])
    for b in (0, 1):
        cache.set_evictable(b)
    cache.touch([0])  # 0: (t3, t5) vs 1: (t2, t4)
    assert cache.pop_evictable() == 1


def test_counters():
    cache = PrefixCache()
    cache.record(4, 3)
    cache.record(2, 0)
    assert (cache.num_queries, cache.num_hits) == (6, 3)
    assert cache.hit_rate == 0.5
