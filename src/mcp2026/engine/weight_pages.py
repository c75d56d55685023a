"""A CPU model's weights in one mapping backed by transparent huge pages.

A decode step streams every weight once: with 4 KiB pages that is a TLB miss every 4 KiB (about 24,000 a step for
the default model), with 2 MiB pages one every 2 MiB. The weights are copied once, before the runner builds its
kernels' state, into one anonymous mapping advised with MADV_HUGEPAGE (resident either way: the copy costs at
most one partly used 2 MiB page), and the heap pages they leave are handed back to the OS."""

from __future__ import annotations

import mmap
import re
import weakref
from pathlib import Path

import torch

from mcp2026 import hardware

_HUGE = 2 << 20
_ALIGN = 64
# Bytes of originals freed between heap trims while copying (a trim walks the heap's free chunks).
_TRIM_EVERY = 16 << 20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# The mapping each placed model's weights live in (the tensors hold it mapped; this marks the model placed
# without an attribute that copying or pickling the model would trip over: a copy's tensors are its own).
_placed: weakref.WeakKeyDictionary[torch.nn.Module, mmap.mmap] = weakref.WeakKeyDictionary()


def placed_mapping(model: torch.nn.Module) -> mmap.mmap | None:
    """The huge-page mapping ``model``'s weights were moved into, or None."""
    return _placed.get(model)


def huge_page_mode() -> str | None:
    """The OS's transparent huge page mode in force ("always", "madvise" or "never": the bracketed one of its
    setting), None where it has no such setting."""
    try:
        chosen = re.search(r"\[(\w+)\]", _THP_SETTING.read_text())
    except OSError:
        return None
    return chosen.group(1) if chosen else None


def huge_pages_available() -> bool:
    """Whether this OS gives an anonymous mapping transparent huge pages when asked (madvise or always)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and huge_page_mode() in ("always", "madvise")


def place_weights_in_huge_pages(model: torch.nn.Module) -> int:
    """Move ``model``'s CPU parameters and buffers (tensors sharing storage stay shared) into one huge-page mapping;
    returns the bytes moved (0 where huge pages are unavailable, nothing is on the CPU, or it was done before)."""
    if model in _placed or not huge_pages_available():
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or tensor.is_mkldnn
            or tensor.is_quantized
        ):
            continue
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    total = sum(-(-storage.nbytes() // _ALIGN) * _ALIGN for storage, _ in storages.values())
    if total == 0:
        return 0
    mapping = mmap.mmap(-1, total + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-whole.data_ptr()) % _HUGE  # the first weight on a 2 MiB boundary
    freed = 0
    with torch.no_grad():
        while storages:  # each original dropped once copied: the copy never holds two whole models
            storage, tensors = storages.pop(next(iter(storages)))  # in module order
            size = storage.nbytes()
            whole[offset : offset + size].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for tensor in tensors:  # offsets count elements; every copy starts 64-byte aligned
                start = offset // tensor.element_size() + tensor.storage_offset()
                tensor.set_(whole.untyped_storage(), start, tensor.shape, tensor.stride())
            offset += -(-size // _ALIGN) * _ALIGN
            del storage, tensors
            freed += size
            if freed >= _TRIM_EVERY:  # glibc keeps freed heap pages resident until trimmed
                hardware.release_free_heap()
                freed = 0
    _placed[model] = mapping
    del whole
    hardware.release_free_heap()
    return total
