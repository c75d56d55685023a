"""Physical KV storage for the paged cache: one K and one V tensor per layer, indexed by slot.

Planar layout (all K, then all V, as in our design notes): ``k[layer]`` and ``v[layer]`` are contiguous
(num_slots, num_kv_heads, head_dim) tensors, slot = block_id * block_size + offset. Logical bookkeeping
(which request owns which block) lives in ``kv.block_pool`` / ``kv.manager``.

On the CPU the storage is an anonymous mmap: untouched pages cost no memory (RSS grows with use, and
read as zeros, so padded reads are always finite), and ``release_blocks`` hands a range of blocks back to
the OS (madvise DONTNEED) when the DTSS takes KV shards offline under memory pressure.
"""

from __future__ import annotations

import math
import mmap

import torch


def _allocate(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, mmap.mmap | None]:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return tensor, buffer


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        self.k, self._k_buffer = _allocate(shape, dtype, torch.device(device))
        self.v, self._v_buffer = _allocate(shape, dtype, torch.device(device))
        self.slot_bytes = num_kv_heads * head_dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: (T,), k/v: (T, nkv, hd)
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape S) -> (*S, nkv, hd)."""
        flat = slots.reshape(-1)
        k = self.k[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat)
        return k.view(*slots.shape, *k.shape[1:]), v.view(*slots.shape, *v.shape[1:])

    def release_blocks(self, start_block: int, end_block: int) -> int:
        """Return the memory of blocks [start, end) to the OS (CPU only); they read as zeros afterwards.
        Returns the number of bytes released (whole pages inside the range, every layer, K and V)."""
        if self._k_buffer is None or end_block <= start_block:
            return 0
        page = mmap.PAGESIZE
        layer_bytes = self.num_slots * self.slot_bytes
        released = 0
        for buffer in (self._k_buffer, self._v_buffer):
            for layer in range(self.num_layers):
                lo = layer * layer_bytes + start_block * self.block_size * self.slot_bytes
                hi = layer * layer_bytes + end_block * self.block_size * self.slot_bytes
                lo, hi = -(-lo // page) * page, hi // page * page
                if hi > lo:
                    buffer.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                    released += hi - lo
        return released
