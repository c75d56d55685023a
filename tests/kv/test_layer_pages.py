"""Per-layer budgets' bookkeeping: quotas by water-filling, per-layer page lists, and packing a request's kept
slots into the fewest of its blocks."""

from __future__ import annotations

import pytest
import torch

from mcp2026.kv.layer_pages import LayerPages, layer_quotas, plan_packing


def test_quotas_share_the_total_in_proportion():
    assert layer_quotas([1, 1, 2], 40, [100, 100, 100], [0, 0, 0]) == [10, 10, 20]
    quotas = layer_quotas([1, 2, 3], 10, [100] * 3, [0] * 3)
    assert sum(quotas) == 10 and quotas[0] <= quotas[1] <= quotas[2]


def test_a_capped_layer_gives_the_rest_to_the_others():
    # layer 2 holds only 5 slots: the 15 it cannot use are shared by the others, by weight
    assert layer_quotas([1, 1, 4], 30, [100, 100, 5], [0, 0, 0]) == [13, 12, 5]


def test_floors_hold_and_the_total_is_clamped_to_what_fits():
    quotas = layer_quotas([1, 100], 20, [50, 50], [8, 0])
    assert quotas[0] == 8 and sum(quotas) == 20
    assert layer_quotas([1, 1], 500, [10, 20], [0, 0]) == [10, 20]  # more than they hold
    assert layer_quotas([1, 1], 2, [10, 20], [4, 4]) == [4, 4]  # less than the floors


@pytest.mark.parametrize("seed", range(20))
def test_quotas_respect_bounds_and_sum_on_random_cases(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 12, (1,), generator=g))
    weights = (torch.rand(n, generator=g) + 0.05).tolist()
    caps = torch.randint(1, 60, (n,), generator=g).tolist()
    floors = [int(c * float(f)) for c, f in zip(caps, torch.rand(n, generator=g))]
    total = int(torch.randint(0, 400, (1,), generator=g))
    quotas = layer_quotas(weights, total, caps, floors)
    assert all(f <= q <= c for f, q, c in zip(floors, quotas, caps))
    assert sum(quotas) == max(sum(floors), min(total, sum(caps)))


def test_pages_are_the_identity_until_packed_then_base_plus_new_blocks():
    pages = LayerPages(num_layers=2, num_blocks=10)
    assert pages.pages("r", [3, 5]) == [[3, 5], [13, 15]]
    assert pages.slot_shift("r") == [0, 0]
    # layer 0 keeps 3 slots, layer 1 one, packed into blocks 3 and 5
    pages.set("r", [[3, 13, 5], [15]], num_table=2)
    assert pages.slot_shift("r") == [-1, 1]
    assert pages.pages("r", [3, 5, 7]) == [[3, 13, 5, 7], [15, 17]]  # block 7 came later: one slot each
    lt = pages.table("r", [3, 5, 7])
    assert lt.pages.tolist() == [[3, 13, 5, 7], [15, 17, 0, 0]] and lt.shift.tolist() == [-1, 1]
    assert lt.num_slots(3).tolist() == [4, 2]
    pages.check_integrity("r", [3, 5, 7])
    with pytest.raises(AssertionError, match="not in its blocks"):
        pages.check_integrity("r", [3, 7])
    pages.forget("r")
    assert pages.pages("r", [3]) == [[3], [13]]


def test_packing_keeps_the_fullest_blocks_and_moves_the_rest():
    # 2 layers, 1 KV head, blocks [4, 6, 8] (pages 4/14, 6/16, 8/18). Layer 0 keeps slots 0, 1, 2; layer 1
    # keeps slot 2 only: 4 pages -> 2 blocks
    pages = [[4, 6, 8], [14, 16, 18]]
    sources = [torch.tensor([[0, 1, 2]]), torch.tensor([[2]])]
    packing = plan_packing(pages, sources, [4, 6, 8], num_blocks=10, num_kv_heads=1)
    # in-layer compaction first: layer 0 stays on 4, 6, 8; layer 1's slot 0 is page 14 (its slot 2's KV moves
    # there). Blocks hold 2 (block 4), 1 (6), 1 (8) kept pages: block 8, the later of the two, goes
    assert packing.released == [2]
    assert packing.pages[1] == [14]
    assert packing.pages[0][:2] == [4, 6] and packing.pages[0][2] in (16,)  # slot 2 moved to a free page
    moves = dict(zip(packing.dst.tolist(), packing.src.tolist()))
    assert moves[16] == 8 and moves[14] == 18  # every copy reads the KV from before the eviction
    used = [p for layer in packing.pages for p in layer]
    assert len(set(used)) == len(used) and {p % 10 for p in used} <= {4, 6}


def test_packing_moves_each_head_from_its_own_slot():
    pages = [[0, 1, 2]]
    sources = [torch.tensor([[0, 2], [1, 2]])]  # head 0 drops slot 1, head 1 drops slot 0
    packing = plan_packing(pages, sources, [0, 1, 2], num_blocks=3, num_kv_heads=2)
    assert packing.released == [2] and packing.pages == [[0, 1]]
    pairs = sorted(zip(packing.dst.tolist(), packing.src.tolist()))
    # chunk = page * 2 + head: head 0 reads pages 0, 2; head 1 reads pages 1, 2
    assert pairs == [(0, 0), (1, 3), (2, 4), (3, 5)]


@pytest.mark.parametrize("seed", range(10))
def test_table_tensors_match_the_page_lists(seed):
    g = torch.Generator().manual_seed(seed)
    pages = LayerPages(num_layers=3, num_blocks=50)
    table = torch.randperm(50, generator=g)[:8].tolist()
    num_table = int(torch.randint(1, 8, (1,), generator=g))
    base = [
        torch.randperm(150, generator=g)[: int(n)].tolist() for n in torch.randint(0, 12, (3,), generator=g)
    ]
    pages.set("r", base, num_table)
    lt = pages.table("r", table)
    lists = pages.pages("r", table)
    for layer, row in enumerate(lists):
        assert lt.pages[layer, : len(row)].tolist() == row
        assert not lt.pages[layer, len(row) :].any()
    assert lt.num_slots(len(table)).tolist() == [len(r) for r in lists]
