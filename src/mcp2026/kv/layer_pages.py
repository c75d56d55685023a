"""Per-layer KV budgets: each layer keeps its own number of blocks, packed into the request's own blocks.

The manager counts whole blocks: block ``b`` is one page per layer, page ``layer * num_blocks + b`` of the flat
pool (``PagedKVCache(layered=True)``). With per-layer budgets a layer's slot ``j`` may live in *any* page of the
request's blocks: a layer that keeps more than the uniform budget stores its extra slots in pages that layers
keeping fewer gave up, so the request still holds ``ceil(sum of kept slots / layers)`` blocks and the scheduler,
the prefix cache and admission see whole blocks as before (vLLM's hybrid KV manager gives each layer group its own
tables over one pool of pages; packing inside the request keeps our manager unchanged).

Until a request's first eviction its pages are the identity (layer ``l``'s page of ``table[j]``). After it, the
first slots of each layer are an explicit page list (``base``), and every table block allocated since gives each
layer one more slot, its own page of that block. ``slot_shift[l]`` (blocks) is how far layer ``l``'s slot index
trails the uniform one: a token at uniform slot ``s`` goes to slot ``s - slot_shift[l]`` of layer ``l``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Packed:
    base: list[list[int]]  # per layer: the pages of its first len(base[l]) slots
    num_table: int  # the table's length when packed; later table blocks add one slot per layer
    padded: torch.Tensor  # (L, longest base) the same pages, padded (what every step's table() reads)
    lengths: torch.Tensor  # (L,) len(base[l])


@dataclass(frozen=True)
class LayerTable:
    """One request's pages per layer, padded: ``pages`` (L, W) long, ``shift`` (L,) long (see module docstring).
    Layer ``l`` has ``num_table - shift[l]`` slots; entries past them are padding."""

    pages: torch.Tensor
    shift: torch.Tensor

    def num_slots(self, num_uniform: int) -> torch.Tensor:
        """(L,) slots of each layer when the uniform view has ``num_uniform``."""
        return num_uniform - self.shift


class LayerPages:
    """Which page holds each slot of each layer, for every request that has evicted (``KVEvictor`` packs)."""

    def __init__(self, num_layers: int, num_blocks: int) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self._packed: dict[str, _Packed] = {}
        # the last LayerTable built per request, and the table blocks it was built from (a decode step reuses it
        # until the table changes: once per block)
        self._memo: dict[str, tuple[tuple[int, ...], LayerTable]] = {}
        self._layer_base = torch.arange(num_layers).unsqueeze(1) * num_blocks  # (L, 1)

    def page(self, layer: int, block: int) -> int:
        return layer * self.num_blocks + block

    def is_packed(self, request_id: str) -> bool:
        return request_id in self._packed

    def pages(self, request_id: str, table: Sequence[int]) -> list[list[int]]:
        """Per layer, the page of each of its slots."""
        packed = self._packed.get(request_id)
        if packed is None:
            return [[self.page(layer, b) for b in table] for layer in range(self.num_layers)]
        tail = table[packed.num_table :]
        return [base + [self.page(layer, b) for b in tail] for layer, base in enumerate(packed.base)]

    def slot_shift(self, request_id: str) -> list[int]:
        packed = self._packed.get(request_id)
        if packed is None:
            return [0] * self.num_layers
        return [packed.num_table - len(base) for base in packed.base]

    def lane_shift(self, request_id: str, num_kv_heads: int) -> torch.Tensor:
        """(L * nkv,) ``slot_shift`` per lane (one layer's one KV head, layer-major)."""
        return torch.tensor(self.slot_shift(request_id)).repeat_interleave(num_kv_heads)

    def table(self, request_id: str, table: Sequence[int]) -> LayerTable:
        """The request's pages as tensors (what the runner and the write plan read)."""
        packed = self._packed.get(request_id)
        key = tuple(table if packed is None else table[packed.num_table :])
        memo = self._memo.get(request_id)
        if memo is not None and memo[0] == key:
            return memo[1]
        built = self._build(packed, table)
        self._memo[request_id] = (key, built)
        return built

    def _build(self, packed: _Packed | None, table: Sequence[int]) -> LayerTable:
        if packed is None:
            ids = torch.tensor(list(table), dtype=torch.long).unsqueeze(0)
            return LayerTable(self._layer_base + ids, torch.zeros(self.num_layers, dtype=torch.long))
        # slot s of layer l: base[l][s], then layer l's page of table[num_table + s - len(base[l])]
        tail = torch.tensor(list(table[packed.num_table :]), dtype=torch.long)
        lengths = packed.lengths.unsqueeze(1)
        slot = torch.arange(packed.padded.shape[1] + len(tail)).unsqueeze(0)
        from_base = packed.padded.gather(
            1, slot.clamp(max=packed.padded.shape[1] - 1).expand(self.num_layers, -1)
        )
        if len(tail):
            from_tail = self._layer_base + tail[(slot - lengths).clamp(0, len(tail) - 1)]
            from_base = torch.where(slot < lengths, from_base, from_tail)
        pages = from_base.masked_fill(slot >= lengths + len(tail), 0)
        return LayerTable(pages, packed.num_table - packed.lengths)

    def set(self, request_id: str, base: list[list[int]], num_table: int) -> None:
        if len(base) != self.num_layers:
            raise ValueError(f"{len(base)} page lists for {self.num_layers} layers")
        width = max(1, max(len(b) for b in base))
        padded = torch.tensor([list(b) + [0] * (width - len(b)) for b in base], dtype=torch.long)
        lengths = torch.tensor([len(b) for b in base], dtype=torch.long)
        self._packed[request_id] = _Packed([list(b) for b in base], num_table, padded, lengths)
        self._memo.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._packed.pop(request_id, None)
        self._memo.pop(request_id, None)

    def check_integrity(self, request_id: str, table: Sequence[int]) -> None:
        """Every slot's page belongs to one of the request's blocks, and no page holds two slots."""
        pages = [p for layer in self.pages(request_id, table) for p in layer]
        assert len(set(pages)) == len(pages), f"request {request_id}: a page holds two slots"
        owned = set(table)
        stray = [p for p in pages if p % self.num_blocks not in owned]
        assert not stray, f"request {request_id}: pages {stray[:8]} are not in its blocks"


def layer_quotas(
    weights: Sequence[float], total: int, caps: Sequence[int], floors: Sequence[int]
) -> list[int]:
    """Integers ``k`` with ``floors <= k <= caps`` summing to ``total`` (clamped to [sum floors, sum caps]), shared
    in proportion to ``weights`` by water-filling: a layer capped at what it holds gives the rest to the others."""
    n = len(weights)
    if not n == len(caps) == len(floors):
        raise ValueError("layer_quotas: weights, caps and floors need one entry per layer")
    floors = [min(f, c) for f, c in zip(floors, caps)]
    total = max(sum(floors), min(total, sum(caps)))

    def filled(scale: float) -> list[float]:
        return [min(max(scale * w, f), c) for w, f, c in zip(weights, floors, caps)]

    lo, hi = 0.0, 1.0
    while sum(filled(hi)) < total:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(filled(mid)) < total:
            lo = mid
        else:
            hi = mid
    exact = filled(hi)
    quotas = [int(x) for x in exact]
    short = total - sum(quotas)
    order = sorted(range(n), key=lambda i: (quotas[i] - exact[i], i))  # largest remainders first
    for i in order:
        if short <= 0:
            break
        if quotas[i] < caps[i]:
            quotas[i] += 1
            short -= 1
    return quotas


@dataclass(frozen=True)
class Packing:
    """One eviction's new layout: each layer's slot pages, the table entries to release, and the chunk copies
    (``PagedKVCache.move_chunks``) that put every kept slot of every head in its new page."""

    pages: list[list[int]]
    released: list[int]  # table indices
    src: torch.Tensor  # chunk ids (page * nkv + head)
    dst: torch.Tensor


def plan_packing(
    pages: Sequence[Sequence[int]],
    sources: Sequence[torch.Tensor],
    table: Sequence[int],
    num_blocks: int,
    num_kv_heads: int,
) -> Packing:
    """Layer ``l`` keeps, in head ``h``'s lane, the slots ``sources[l][h]`` (increasing) of its slots
    ``pages[l]``. Each kept slot ``j`` first stays where slot ``j`` was (what each layer keeps moves down in its
    own pages, as uniform eviction compacts); then the request keeps ``ceil(kept / layers)`` of its blocks: those
    holding the most kept pages (earlier ones on ties), and pages in the others move to the free pages of the kept
    ones. Every copy reads the KV as it was before the eviction."""
    num_layers = len(pages)
    final = [list(layer[: s.shape[1]]) for layer, s in zip(pages, sources)]
    used = {p for layer in final for p in layer}
    per_block = [0] * len(table)
    where = {b: i for i, b in enumerate(table)}
    for p in used:
        per_block[where[p % num_blocks]] += 1
    num_keep = -(-len(used) // num_layers)
    order = sorted(range(len(table)), key=lambda i: (per_block[i], -i))
    released = sorted(order[: len(table) - num_keep])
    gone = {table[i] for i in released}
    free = iter(
        sorted(
            layer * num_blocks + b
            for b in table
            if b not in gone
            for layer in range(num_layers)
            if layer * num_blocks + b not in used
        )
    )
    for layer in final:
        for j, p in enumerate(layer):
            if p % num_blocks in gone:
                layer[j] = next(free)
    heads = torch.arange(num_kv_heads).unsqueeze(1)
    src, dst = [], []
    for old, new, kept in zip(pages, final, sources):
        if not new:
            continue
        old_pages = torch.tensor(list(old), dtype=torch.long)[kept]  # (nkv, K): where each kept slot was
        new_pages = torch.tensor(new, dtype=torch.long).unsqueeze(0)  # (1, K)
        src.append((old_pages * num_kv_heads + heads).flatten())
        dst.append((new_pages * num_kv_heads + heads).flatten())
    empty = torch.zeros(0, dtype=torch.long)
    return Packing(final, released, torch.cat(src) if src else empty, torch.cat(dst) if dst else empty)


def repoint_packing(
    packing: Packing, changed: dict[int, int], whole: torch.Tensor, num_blocks: int, num_kv_heads: int
) -> Packing:
    """``packing`` after ``KVCacheManager.privatize`` replaced blocks with fresh ones (``changed``: old -> new):
    every destination page of an old block (and the new layout) points at the same page of its new block, and
    the old blocks' other chunks (``whole``: every chunk of the old blocks, ``PagedKVCache.block_chunks``) are
    copied over too. The sources stay the old blocks, whose bytes are intact until the next allocation:
    ``move_chunks`` reads every source before it writes, so one call does both."""
    nb, nkv = num_blocks, num_kv_heads
    block_map = torch.arange(nb)
    block_map[torch.tensor(list(changed))] = torch.tensor(list(changed.values()))

    def repoint(ids: torch.Tensor) -> torch.Tensor:
        page, head = ids // nkv, ids % nkv
        return ((page // nb) * nb + block_map[page % nb]) * nkv + head

    dst = repoint(packing.dst)
    rest = whole[~torch.isin(repoint(whole), dst)]  # to the same chunks of the new blocks
    layout = [[(p // nb) * nb + changed.get(p % nb, p % nb) for p in layer] for layer in packing.pages]
    return Packing(layout, packing.released, torch.cat([rest, packing.src]), torch.cat([repoint(rest), dst]))
