"""A GGUF file's header, metadata and tensor table read without touching tensor data, so the doctor can
say whether every tensor lies inside the file (a truncated download) in well under a second.

The parsing is the loader's (loading/gguf_file.py); this adapts it to the doctor's report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp2026.loading.gguf_file import GGUF_MAGIC, SUPPORTED_VERSIONS, GGUFFile

__all__ = ["GGUF_MAGIC", "SUPPORTED_VERSIONS", "GgufHeader", "GgufTensor", "read_gguf_header"]


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    data_start: int
    file_bytes: int
    type_counts: dict[str, int] = field(default_factory=dict)

    @property
    def data_end(self) -> int:
        """Byte just past the last tensor's data."""
        return self.data_start + max((t.offset + t.nbytes for t in self.tensors), default=0)


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Parse magic, version, metadata and tensor table; ValueError says what is wrong."""
    parsed = GGUFFile.open(path)  # GGUFFormatError is a ValueError
    tensors = [
        GgufTensor(t.name, t.dims, t.tensor_type.name, t.offset - parsed.data_start, t.nbytes)
        for t in parsed.tensors
    ]
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    return GgufHeader(parsed.version, parsed.metadata, tensors, parsed.data_start, parsed.file_bytes, counts)
