"""The prefix-aware replica router, without Ray or a model: replicas are simulated prefix caches holding the
block chains they computed, and a multi-turn workload is routed turn by turn."""

from __future__ import annotations

import random

import pytest

from mcp2026.serve.replica_router import PrefixRouter, ReplicaLoad, RouterConfig

BLOCK = 16


def conversations(num: int, num_turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn: every turn repeats the previous ones and adds ~3 blocks."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        prompt: list[int] = []
        turns = []
        for _ in range(num_turns):
            prompt = prompt + [rng.randrange(50_000) for _ in range(rng.randrange(2 * BLOCK, 4 * BLOCK))]
            turns.append(prompt)
        out.append(turns)
    return out


def hit_rate(pick, num_replicas: int, convs: list[list[list[int]]]) -> float:
    """Share of the prompts' full blocks found in the chosen replica's cache (it caches what it computes)."""
    hasher = PrefixRouter(["h"], RouterConfig(block_size=BLOCK))
    caches: list[set[bytes]] = [set() for _ in range(num_replicas)]
    hits = total = 0
    for turn in range(len(convs[0])):  # turns interleaved across conversations, as live traffic is
        for conv in convs:
            hashes = hasher.block_hashes(conv[turn])
            cache = caches[pick(conv[turn])]
            hits += sum(h in cache for h in hashes)
            total += len(hashes)
            cache.update(hashes)
    return hits / total


def test_multi_turn_hit_rate_with_two_replicas_keeps_the_single_replica_rate():
    convs = conversations(40, 6)
    single = hit_rate(lambda _: 0, 1, convs)
    router = PrefixRouter(["a", "b"], RouterConfig(block_size=BLOCK))
    index = {"a": 0, "b": 1}
    routed = hit_rate(lambda ids: index[router.route(ids, {}).replica_id], 2, convs)
    rng = random.Random(1)
    scattered = hit_rate(lambda _: rng.randrange(2), 2, convs)
    assert single > 0.6  # the workload does reuse its prefixes
    assert routed >= 0.9 * single
    assert scattered < 0.75 * single  # without affinity, a turn often lands where its prefix is not


def test_new_prefixes_are_balanced_even_behind_a_shared_system_prompt():
    router = PrefixRouter(["a", "b", "c"], RouterConfig(block_size=BLOCK))
    system = list(range(2 * BLOCK))
    rng = random.Random(0)
    picks = [
        router.route(system + [rng.randrange(50_000) for _ in range(8 * BLOCK)], {}).replica_id
        for _ in range(30)
    ]
    assert {p: picks.count(p) for p in set(picks)} == {"a": 10, "b": 10, "c": 10}


def test_a_saturated_holder_gives_way_to_the_least_loaded():
    router = PrefixRouter(["a", "b"], RouterConfig(block_size=BLOCK, max_waiting=4))
    prompt = list(range(4 * BLOCK))
    first = router.route(prompt, {})
    other = "b" if first.replica_id == "a" else "a"
    assert router.route(prompt + [1] * BLOCK, {}) == (first.replica_id, "prefix", 4)
    busy = {first.replica_id: ReplicaLoad(num_waiting=5), other: ReplicaLoad(num_running=3)}
    assert router.route(prompt, busy) == (other, "saturated", 4)
    full_kv = {first.replica_id: ReplicaLoad(kv_usage=0.99)}
    assert router.route(list(range(1000, 1000 + 4 * BLOCK)), full_kv).replica_id == other
    assert router.route(prompt, {}).replica_id == other  # the chain now lives where it was recomputed


def test_tenants_do_not_share_prefixes():
    router = PrefixRouter(["a", "b"], RouterConfig(block_size=BLOCK))
    prompt = list(range(3 * BLOCK))
    router.route(prompt, {}, cache_salt="tenant-1")
    assert router.route(prompt, {}, cache_salt="tenant-2").reason == "balance"
    assert router.route(prompt, {}, cache_salt="tenant-1").reason == "prefix"
    assert router.block_hashes(prompt, "x") != router.block_hashes(prompt, "y")
    assert router.block_hashes(list(range(BLOCK - 1))) == []  # no full block, nothing to match


def test_memory_is_bounded_and_forget_drops_a_replica():
    router = PrefixRouter(["a", "b"], RouterConfig(block_size=BLOCK, max_entries=10))
    for start in range(0, 100 * BLOCK, 4 * BLOCK):
        router.route(list(range(start, start + 4 * BLOCK)), {})
    assert len(router._owner) == 10
    prompt = list(range(10_000, 10_000 + 2 * BLOCK))
    holder = router.route(prompt, {}).replica_id
    router.forget(holder)
    assert router.route(prompt, {}).reason == "balance"


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one replica"):
        PrefixRouter([])
    with pytest.raises(ValueError, match="distinct"):
        PrefixRouter(["a", "a"])
    with pytest.raises(ValueError, match="min_match_ratio"):
        RouterConfig(min_match_ratio=0)
    with pytest.raises(ValueError, match="block_size"):
        RouterConfig(block_size=0)
    with pytest.raises(ValueError, match="unknown replicas"):
        PrefixRouter(["a"]).route([1] * BLOCK, {"z": ReplicaLoad()})
