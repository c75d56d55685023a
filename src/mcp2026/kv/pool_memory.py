"""Memory for the KV pool's planes. On the CPU each plane is an anonymous mmap: untouched pages cost no memory
(RSS grows with use, and read as zeros, so padded reads are always finite), and a range of blocks can go back to
the OS (madvise DONTNEED) when the DTSS takes KV shards offline under memory pressure.
"""

from __future__ import annotations

import math
import mmap

import torch


def allocate_plane(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed tensor, and on the CPU the mmap behind it (None elsewhere)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device), None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return tensor, buffer


def release_block_range(
    buffer: mmap.mmap, plane: torch.Tensor, start_block: int, end_block: int, free_above: bool = False
) -> int:
    """Hand blocks [start, end) of every layer of ``plane`` (layers, blocks, ...), held by ``buffer``, back to the
    OS; they read as zeros afterwards. Returns the bytes released (whole pages inside the range; with
    ``free_above`` - the blocks after ``end`` hold nothing - also the page ``end`` falls in)."""
    page = mmap.PAGESIZE
    num_layers, num_blocks = plane.shape[:2]
    block_bytes = plane[0, 0].numel() * plane.element_size()
    layer_bytes = num_blocks * block_bytes
    released = 0
    for layer in range(num_layers):
        lo = layer * layer_bytes + start_block * block_bytes
        hi = layer * layer_bytes + end_block * block_bytes
        lo = -(-lo // page) * page
        hi = min(-(-hi // page) * page, (layer + 1) * layer_bytes) if free_above else hi // page * page
        if hi > lo:
            buffer.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            released += hi - lo
    return released
