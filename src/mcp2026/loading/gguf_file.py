"""A GGUF file's header, metadata and tensor table, parsed with ``struct`` over an mmap; tensor data is
returned as zero-copy byte views for ``gguf.quants.dequantize``.

NOTE: ``gguf.GGUFReader`` builds a numpy memmap view per array element while it parses (about 1.2 million of
them for SmolLM2's 49k-token vocabulary and merges), which takes 3-10 s on this machine; this reader parses
the same file in a fraction of a second. The ``gguf`` package stays the authority for tensor types, block
sizes and dequantization.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
ValueType = tuple[int, int | None]  # a metadata value's gguf.GGUFValueType, and its items' for an array


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (bad magic, old version, damage)."""


@dataclass
class _Cursor:
    buf: Any  # the mmap'ed file
    endian: str
    pos: int

    def pairs(self, num_kv: int) -> Iterable[tuple[str, ValueType, Any]]:
        for _ in range(num_kv):
            key = self.string()
            kind = self.scalar("I")
            item_kind = (
                struct.unpack_from(self.endian + "I", self.buf, self.pos)[0] if kind == _ARRAY else None
            )
            yield key, (kind, item_kind), self.value(kind)

    def scalar(self, fmt: str) -> Any:
        return self.array(fmt, 1)[0]

    def array(self, fmt: str, count: int) -> list[Any]:
        fmt = f"{self.endian}{count}{fmt}"
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return list(values)

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings: one tight loop, as a vocabulary holds tens of thousands."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        size_at = struct.Struct(self.endian + "Q").unpack_from
        out = []
        for _ in range(count):
            (size,) = size_at(buf, pos)
            pos += 8
            if pos + size > end:
                raise GGUFFormatError(f"string of {size} bytes at byte {pos} runs past the end of the file")
            out.append(buf[pos : pos + size].decode("utf-8"))
            pos += size
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            if item_kind in _SCALARS:
                return self.array(_SCALARS[item_kind], count)
            if item_kind == _STRING:
                return self.strings(count)
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return self.scalar(_SCALARS[kind])


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the contiguous (row) length
    type_id: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def tensor_type(self) -> Any:
        return GGMLQuantizationType(self.type_id)

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy / PyTorch order (rows last-to-first), as ``gguf`` reports it."""
        return tuple(reversed(self.dims))


def _tensor_bytes(name: str, dims: tuple[int, ...], type_id: int) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"tensor {name} has unknown ggml type id {type_id}") from None
    if dims and dims[0] % block:
        raise GGUFFormatError(f"tensor {name}: row length {dims[0]} is not a multiple of its block {block}")
    return math.prod(dims) // block * type_size


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    data_start: int
    file_bytes: int
    # each metadata key's stored type, so a writer can copy a value exactly as it was stored
    value_types: dict[str, ValueType] = dataclass_field(default_factory=dict)

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def data_end(self) -> int:
        """The byte just past the last tensor's data."""
        return max((t.offset + t.nbytes for t in self.tensors), default=self.data_start)

    def truncated_tensors(self) -> list[GGUFTensorInfo]:
        return [t for t in self.tensors if t.offset + t.nbytes > self.file_bytes]

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view shaped (*outer dims, bytes per row), the layout
        ``gguf.quants.dequantize`` takes for every type."""
        self._check_in_file(info)
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        rows = math.prod(info.dims[1:]) if len(info.dims) > 1 else 1
        return data.reshape(*reversed(info.dims[1:]), info.nbytes // rows)

    def _check_in_file(self, info: GGUFTensorInfo) -> None:
        if info.offset + info.nbytes > self.file_bytes:
            raise GGUFFormatError(
                f"tensor {info.name} ends at byte {info.offset + info.nbytes} but the file has "
                f"{self.file_bytes} bytes (truncated download?)"
            )

    def read_rows(self, info: GGUFTensorInfo, start: int, end: int) -> np.ndarray:
        """Rows [start, end) of a matrix's bytes, (rows, bytes per row), read into memory of their own: unlike
        ``raw``'s mapping, nothing of the file stays resident once they are dropped."""
        self._check_in_file(info)
        row_bytes = info.nbytes // info.dims[1]
        data = np.fromfile(
            self.path, dtype=np.uint8, count=(end - start) * row_bytes, offset=info.offset + start * row_bytes
        )
        return data.reshape(end - start, row_bytes)

    @classmethod
    def open(cls, path: str | os.PathLike[str], tensors: bool = True) -> GGUFFile:
        """Parse the header (and the tensor table unless ``tensors=False``); GGUFFormatError on damage."""
        path = Path(path)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return cls._parse(path, buf, tensors)
        except GGUFFormatError:
            raise
        except struct.error as e:
            raise GGUFFormatError(f"the header ends early ({e}): the file is truncated") from None
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"the header is corrupted ({e})") from None
        except ValueError as e:  # mmap of an empty file
            raise GGUFFormatError(f"not a GGUF file: {e}") from None

    @classmethod
    def _parse(cls, path: Path, buf: Any, with_tensors: bool) -> GGUFFile:
        if len(buf) < 24:
            raise GGUFFormatError(
                f"not a GGUF file: {len(buf)} bytes, too short for a GGUF header (24 bytes)"
            )
        if buf[:4] != GGUF_MAGIC:
            raise GGUFFormatError(
                f"bad magic bytes {bytes(buf[:4])!r} (expected {GGUF_MAGIC!r}): not a GGUF file"
            )
        endian = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
        version, num_tensors, num_kv = struct.unpack_from(endian + "IQQ", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        cursor = _Cursor(buf, endian, 24)
        metadata: dict[str, Any] = {}
        value_types: dict[str, ValueType] = {}
        for key, value_type, value in cursor.pairs(num_kv):
            metadata[key], value_types[key] = value, value_type
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        if with_tensors:
            for _ in range(num_tensors):
                name = cursor.string()
                dims = tuple(cursor.array("Q", cursor.scalar("I")))
                type_id, rel_offset = cursor.scalar("I"), cursor.scalar("Q")
                infos.append((name, dims, type_id, rel_offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        if infos and endian == ">":
            raise GGUFFormatError("big-endian GGUF tensor data is not supported; convert the file on x86/ARM")
        tensors = tuple(
            GGUFTensorInfo(name, dims, type_id, data_start + rel, _tensor_bytes(name, dims, type_id))
            for name, dims, type_id, rel in infos
        )
        return cls(path, version, metadata, tensors, data_start, len(buf), value_types)
