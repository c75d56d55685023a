"""Where a step's new tokens go in the paged cache: a ``WritePlan``, the same for every layer, and the planner
that makes it from each request's start, token count and block table.

Unstaged codecs write (token, head) rows. Staged codecs (``kv.staging``) seal the blocks a step fills (staged
tokens + new tokens, encoded into the pool) and stage the new tail; the plan says which staging entry each
request holds after the step, which ``PagedKVCache.commit`` applies once the step ran.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mcp2026.kv.layer_pages import LayerTable
from mcp2026.kv.staging import StagingStore

# (request id, start slot, number of tokens, block table; a layered cache takes each request's LayerTable)
WriteChunk = tuple[str, int, int, Sequence[int] | LayerTable]


@dataclass
class WritePlan:
    """Where one step's T new tokens go (the same for every layer; a layered cache's ``rows`` and
    ``seal_chunk_ids`` have one row per layer). Rows index a plane viewed as (num_blocks * nkv * bs, *row):
    row = (block * nkv + head) * bs + offset (a layered cache's flat pool: page for block); staging likewise.

    Unstaged codecs: (token, head) rows ``rows`` (T * nkv,). Staged codecs: full blocks (chunks
    ``seal_chunk_ids``) are assembled from new tokens ``seal_src`` (NS*bs,) and staged (token, head) rows
    ``seal_stage_src`` placed at tokens ``seal_stage_dst``, encoded and written; tail tokens ``tail_src`` go
    to staging rows ``tail_dst`` (Tt * nkv,).
    """

    rows: torch.Tensor | None = None
    seal_chunk_ids: torch.Tensor | None = None
    seal_src: torch.Tensor | None = None
    seal_stage_dst: torch.Tensor | None = None
    seal_stage_src: torch.Tensor | None = None
    tail_dst: torch.Tensor | None = None
    tail_src: torch.Tensor | None = None
    tail_is_whole_step: bool = False  # every new token goes to staging (no seal): tail_src is all T, in order
    stage_after: dict[str, int | None] = field(default_factory=dict)  # request -> staging index after it
    is_monitored: bool = False  # measure the round-trip error of this step's writes

    def for_layer(self, layer: int) -> WritePlan:
        """A layered cache's plan as one layer writes it (its row of ``rows`` / ``seal_chunk_ids``): a shallow
        copy, cheaper than ``dataclasses.replace``, which rebuilds through ``__init__`` (every layer of every
        step makes one)."""
        plan = copy.copy(self)
        plan.rows = None if self.rows is None else self.rows[layer]
        plan.seal_chunk_ids = None if self.seal_chunk_ids is None else self.seal_chunk_ids[layer]
        return plan

    def to(self, device: torch.device) -> WritePlan:
        if device.type == "cpu":
            return self
        moved = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in self.__dict__.items()
        }
        return WritePlan(**moved)


class WritePlanner:
    """Plans writes into a cache of ``block_size``-token blocks of ``num_kv_heads`` heads; ``layered``: a flat pool
    of pages read through per-layer tables; ``staging``: a staged codec's store (None for unstaged codecs)."""

    def __init__(
        self, block_size: int, num_kv_heads: int, layered: bool, staging: StagingStore | None
    ) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.layered = layered
        self.staging = staging

    def plan(self, chunks: Sequence[WriteChunk], is_monitored: bool) -> WritePlan:
        """Plan a step's writes, the step's tokens in the order of ``chunks``. Pure: nothing changes."""
        if self.staging is not None:
            return self._plan_staged(chunks, is_monitored)
        bs = self.block_size
        if self.layered:  # (L, T * nkv): token p of a chunk goes to slot p // bs - shift of each layer
            rows = []
            for _, start, n, lt in chunks:
                pos = torch.arange(start, start + n)
                slots = (pos // bs).unsqueeze(0) - lt.shift.unsqueeze(1)  # (L, n)
                pages = lt.pages.gather(1, slots)
                rows.append(self._layer_rows(pages, pos % bs))
            return WritePlan(rows=torch.cat(rows, dim=1), is_monitored=is_monitored)
        bases = [table[p // bs] for _, start, n, table in chunks for p in range(start, start + n)]
        offsets = [p % bs for _, start, n, _ in chunks for p in range(start, start + n)]
        return WritePlan(rows=self._rows(bases, offsets), is_monitored=is_monitored)

    def _layer_rows(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(L, n * nkv) rows of tokens at ``offsets`` (n,) in pages (L, n)."""
        heads = torch.arange(self.num_kv_heads)
        rows = (pages.unsqueeze(2) * self.num_kv_heads + heads) * self.block_size + offsets.view(1, -1, 1)
        return rows.flatten(1)

    def _rows(self, chunk_base: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
        """(token, head) rows (n * nkv,) of tokens at ``offsets`` in blocks / staging entries ``chunk_base``."""
        heads = torch.arange(self.num_kv_heads)
        base = torch.tensor(chunk_base, dtype=torch.long).unsqueeze(1) * self.num_kv_heads
        return (
            (base + heads) * self.block_size + torch.tensor(offsets, dtype=torch.long).unsqueeze(1)
        ).flatten()

    def _plan_staged(self, chunks: Sequence[WriteChunk], is_monitored: bool) -> WritePlan:
        bs = self.block_size
        seal_ids: list = []  # block ids; a layered cache's (L, k) page tensors
        seal_src: list[int] = []  # per sealed token: its index among the new tokens (or a dummy)
        stage_dst: list[int] = []  # sealed tokens that come from staging ...
        stage_base: list[int] = []  # ... their staging entry and offset
        stage_off: list[int] = []
        tail_base: list[int] = []
        tail_off: list[int] = []
        tail_src: list[int] = []
        after: dict[str, int | None] = {}
        taken: set[int] = set()
        tok0 = 0
        for rid, start, n, table in chunks:
            end = start + n
            current = self.staging.index(rid)
            if start % bs and current is None:
                raise AssertionError(f"request {rid}: block {start // bs} is partly written but not staged")
            first, last = start // bs, end // bs  # blocks [first, last) fill in this step
            if last > first:
                head = start % bs  # staged tokens at the start of the first sealed block
                stage_dst.extend(range(len(seal_src), len(seal_src) + head))
                stage_base.extend([current] * head)
                stage_off.extend(range(head))
                if isinstance(table, LayerTable):  # (L, k) pages, one row per layer
                    slots = torch.arange(first, last).unsqueeze(0) - table.shift.unsqueeze(1)
                    seal_ids.append(table.pages.gather(1, slots))
                else:
                    seal_ids.extend(table[first:last])
                seal_src.extend([tok0] * head)
                seal_src.extend(range(tok0, tok0 + last * bs - start))
            if end % bs:
                idx = current if (last == first and current is not None) else self.staging.take(taken)
                lo = max(start, last * bs)
                tail_base.extend([idx] * (end - lo))
                tail_off.extend(p % bs for p in range(lo, end))
                tail_src.extend(range(tok0 + lo - start, tok0 + n))
                after[rid] = idx
            else:
                after[rid] = None
            tok0 += n

        def tensor(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.long) if values else None

        plan = WritePlan(stage_after=after, is_monitored=is_monitored)
        if seal_ids and self.layered:  # (L, NS * nkv)
            pages = torch.cat(seal_ids, dim=1).unsqueeze(2)
            plan.seal_chunk_ids = (pages * self.num_kv_heads + torch.arange(self.num_kv_heads)).flatten(1)
        elif seal_ids:
            blocks = torch.tensor(seal_ids, dtype=torch.long).unsqueeze(1)
            plan.seal_chunk_ids = (blocks * self.num_kv_heads + torch.arange(self.num_kv_heads)).flatten()
        if seal_ids:
            plan.seal_src = tensor(seal_src)
        if stage_dst:
            plan.seal_stage_dst, plan.seal_stage_src = tensor(stage_dst), self._rows(stage_base, stage_off)
        if tail_src:
            plan.tail_dst, plan.tail_src = self._rows(tail_base, tail_off), tensor(tail_src)
            plan.tail_is_whole_step = not seal_ids and len(tail_src) == tok0
        return plan
