"""The staging store of a staged KV codec (int4 KIVI keys are quantized per channel over a block's tokens): each
request's last, not yet full block, kept in 16 bits until it fills and is sealed into the pool.

Entries belong to requests and grow on demand. A step's changes (which entry each request holds after it) come
from its ``WritePlan`` and apply at ``commit``, after the forward succeeded, so a failed step can be rerun; a
sealing step stages the new tail in a fresh entry, so the entry it reads stays intact until then. A read names
a staged block by ``num_blocks + entry`` (``PagedKVCache.block_read``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def staging_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage of a staged codec's unfilled blocks: 16 bits (fp32 models stage in bf16)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


SavedEntries = dict[str, tuple[int, torch.Tensor, torch.Tensor] | None]


class StagingStore:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (num_layers, num_kv_heads, block_size, head_dim)  # of one entry, entries after the layer
        self.dtype = dtype
        self.device = device
        # (L, entries, nkv, bs, hd) each once something was staged; empty before (KIVI keeps its residual in fp16)
        self.k = self.v = torch.empty(0)
        self._entries: dict[str, int] = {}
        self._free: set[int] = set()

    @property
    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()

    @property
    def num_staged(self) -> int:
        return len(self._entries)

    @property
    def is_allocated(self) -> bool:
        return self.k.dim() > 1

    def index(self, request_id: str) -> int | None:
        """The entry holding the request's staged tail, if any (as of the last commit)."""
        return self._entries.get(request_id)

    def take(self, taken: set[int]) -> int:
        """A free entry not in ``taken`` (which it joins), growing the store when there is none."""
        available = self._free - taken
        if not available:
            self._grow()
            available = self._free - taken
        idx = min(available)
        taken.add(idx)
        return idx

    def _grow(self) -> None:
        old = self.k.shape[1] if self.is_allocated else 0
        new = max(8, 2 * old)
        num_layers, *chunk = self.shape
        k = torch.zeros(num_layers, new, *chunk, dtype=self.dtype, device=self.device)
        v = torch.zeros(num_layers, new, *chunk, dtype=self.dtype, device=self.device)
        if old:
            k[:, :old], v[:, :old] = self.k, self.v
        self.k, self.v = k, v
        self._free.update(range(old, new))

    def commit(self, stage_after: Mapping[str, int | None]) -> None:
        """A step ran: each request now holds entry ``stage_after[request]`` (None: nothing staged)."""
        for rid, idx in stage_after.items():
            old = self._entries.pop(rid, None)
            if idx is not None:
                self._entries[rid] = idx
                self._free.discard(idx)
            if old is not None and old != idx:
                self._free.add(old)

    def release(self, request_ids: Iterable[str]) -> None:
        """Requests finished or preempted: their entries are free again."""
        for rid in request_ids:
            idx = self._entries.pop(rid, None)
            if idx is not None:
                self._free.add(idx)

    def save(self, request_ids: Iterable[str]) -> SavedEntries:
        """The requests' staged tails (entry, K, V), for ``restore`` after a lookahead draft."""
        saved: SavedEntries = {}
        for rid in request_ids:
            idx = self._entries.get(rid)
            saved[rid] = None if idx is None else (idx, self.k[:, idx].clone(), self.v[:, idx].clone())
        return saved

    def restore(self, saved: SavedEntries) -> None:
        """Put the saved staged tails back, in their own entries: release every saved request's entry first (a
        draft that sealed a block may have taken another request's old entry), then restore."""
        self.release(saved)
        for rid, entry in saved.items():
            if entry is not None:
                idx, k, v = entry
                self._free.discard(idx)
                self._entries[rid] = idx
                self.k[:, idx], self.v[:, idx] = k, v

    def rows(self, layer: int, entry: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` staged tokens of ``entry``: K and V (nkv, count, hd), staging dtype."""
        return self.k[layer, entry, :, :count], self.v[layer, entry, :, :count]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V stores (entries, nkv, bs, hd), empty when nothing was ever staged."""
        if not self.is_allocated:
            return self.k, self.v
        return self.k[layer], self.v[layer]
