"""Block pool: allocation, reference counts, parking, integrity checks and DTSS shards."""

from __future__ import annotations

import heapq

import pytest

from mcp2026.kv.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.usage == pytest.approx(3 / 8)
    pool.incref([1])
    assert pool.free(ids) == []
    assert pool.ref_count(1) == 1 and pool.num_free_blocks == 7
    pool.free([1])
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.check_integrity([])


def test_allocate_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_integrity()


def test_double_free_and_incref_of_free_block_are_errors():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="ref count"):
        pool.free([b])
    with pytest.raises(AssertionError, match="free block"):
        pool.incref([b])


def test_parked_blocks_are_neither_free_nor_used_until_revived_or_reclaimed():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.free([a, b], park=[a]) == [a]
    assert pool.is_parked(a) and pool.num_free_blocks == 3 and pool.num_parked_blocks == 1
    pool.check_integrity([])
    pool.incref([a])  # a prefix hit revives it
    assert not pool.is_parked(a) and pool.ref_count(a) == 1
    pool.free([a], park=[a])
    pool.reclaim([a])
    assert pool.num_free_blocks == 4
    pool.check_integrity([])


def test_check_integrity_reports_broken_invariants():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.check_integrity([ids])
    with pytest.raises(AssertionError, match="disagree"):
        pool.check_integrity([ids[:1]])  # a table lost a reference
    pool._ref_counts[3] = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_integrity()
    pool._ref_counts[3] = 0
    pool._ref_counts[2] = 1  # free-listed but used
    with pytest.raises(AssertionError, match="both free and used"):
        pool.check_integrity()


def test_check_integrity_detects_lost_blocks():
    pool = BlockPool(4)
    assert heapq.heappop(pool._free_lists[0]) == 0
    pool._is_free[0] = False
    with pytest.raises(AssertionError, match="!= 4 blocks"):
        pool.check_integrity()


def test_shards_are_contiguous_and_allocation_prefers_low_shards():
    pool = BlockPool(10, num_shards=3)  # uneven: 3 + 3 + 4
    assert [pool.shard_of(b) for b in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    ids = pool.allocate(5)
    assert sorted(ids) == [0, 1, 2, 3, 4]


def test_release_and_grow_shards():
    pool = BlockPool(8, num_shards=4)
    ids = pool.allocate(7)  # blocks 0..6: shard 3 holds 6 (used) and 7 (free)
    in_use = pool.release_shards(1)
    assert in_use == [6]
    assert pool.num_online_blocks == 6 and pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free([6])  # the holder is preempted: the block returns to the offline shard's list
    assert pool.num_free_blocks == 0
    pool.check_integrity([[b for b in ids if b != 6]])
    pool.grow_shards(1)
    assert pool.num_free_blocks == 2 and pool.allocate(2) == [6, 7]


def test_release_shards_bounds():
    pool = BlockPool(8, num_shards=2)
    with pytest.raises(ValueError, match="one must stay"):
        pool.release_shards(2)
    with pytest.raises(ValueError):
        pool.grow_shards(1)
    pool.release_shards(1)
    assert pool.usage == 0.0 and pool.num_online_blocks == 4


def test_offline_blocks_are_never_parked():
    pool = BlockPool(4, num_shards=2)
    ids = pool.allocate(4)
    pool.release_shards(1)
    assert pool.free(ids, park=ids) == [0, 1]
    pool.check_integrity([])


def test_allocation_takes_the_lowest_free_blocks():
    pool = BlockPool(8)
    a = pool.allocate(4)
    pool.free([a[1], a[3]])
    pool.free([a[0]], park=[a[0]])
    # holes are refilled from the bottom, not from the most recently freed block
    assert pool.allocate(2) == [1, 3]
    assert pool.allocate(1) == [4]


def test_release_free_runs_hands_back_free_blocks_between_and_above_the_held_ones_once():
    pool = BlockPool(16)
    blocks = pool.allocate(10)  # 0..9 written
    assert pool.release_free_runs() == []  # everything written is held
    pool.free(blocks[4:])  # 4..9 free
    pool.free([blocks[1]])  # a hole between held blocks
    pool.free([blocks[3]], park=[blocks[3]])  # a parked block still holds its contents
    # the hole (1), and the top from 4 up (never-written 10..15 included: nothing above is held)
    assert pool.release_free_runs() == [(1, 2, False), (4, 16, True)]
    assert pool.release_free_runs() == []  # released once; nothing written since
    assert pool.allocate(2) == [1, 4]  # written again
    pool.reclaim([3])
    pool.free([1, 4])
    assert pool.release_free_runs() == [(1, 2, False), (3, 16, True)]
    pool.check_integrity()
