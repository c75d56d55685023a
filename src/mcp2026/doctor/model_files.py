"""Model files checked without loading weights: GGUF header and tensor table, HF config.json and
safetensors headers (8-byte length + JSON), compiled artifacts; every tensor's data must lie in its file."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp2026.config import ModelConfig
from mcp2026.doctor.gguf_header import GgufHeader, read_gguf_header
from mcp2026.errors import ModelLoadError
from mcp2026.loading import gguf as gguf_loading
from mcp2026.loading import hf
from mcp2026.models.registry import resolve_architecture
from mcp2026.quant.artifact import WEIGHTS_FILE, read_metadata

# safetensors dtype -> bytes per element
SAFETENSORS_ITEM_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on the JSON header


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    file_format: str  # "gguf" | "safetensors" | "mcp2026-artifact"
    file_bytes: int  # weight files only
    num_tensors: int
    tensor_types: dict[str, int]  # stored type -> count
    gguf: GgufHeader | None = None
    raw_config: dict[str, Any] | None = None  # config.json, or the artifact's model_config

    @property
    def summary(self) -> str:
        version = f" v{self.gguf.version}" if self.gguf else ""
        types = ", ".join(f"{k} x{v}" for k, v in sorted(self.tensor_types.items()))
        return f"{self.file_format}{version}, {self.num_tensors} tensors ({types}), {self.file_bytes / 2**20:.1f} MiB"


def check_safetensors(path: Path) -> dict[str, int]:
    """Parse a safetensors header and check every tensor's byte range; returns dtype -> tensor count."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: {size} bytes, too short for a safetensors header")
        length = int.from_bytes(head, "little")
        if length > MAX_SAFETENSORS_HEADER or 8 + length > size:
            raise ModelLoadError(
                f"{path}: header length {length} does not fit the {size}-byte file (corrupted)"
            )
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the safetensors header is not a JSON object")
    counts: dict[str, int] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: tensor {name} lacks dtype/shape/data_offsets") from None
        item = SAFETENSORS_ITEM_BYTES.get(dtype)
        if item is not None and stop - begin != math.prod(shape) * item:
            raise ModelLoadError(
                f"{path}: tensor {name} spans {stop - begin} bytes but {dtype}{list(shape)} needs "
                f"{math.prod(shape) * item}"
            )
        counts[dtype] = counts.get(dtype, 0) + 1
        end = max(end, stop)
    if 8 + length + end > size:
        raise ModelLoadError(
            f"{path}: truncated: tensor data ends at byte {8 + length + end} but the file has {size} bytes"
        )
    return counts


def _merge(total: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0) + v


def _inspect_gguf(path: Path) -> ModelFiles:
    try:
        header = read_gguf_header(path)
    except ValueError as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from None
    if header.data_end > header.file_bytes:
        missing = header.data_end - header.file_bytes
        raise ModelLoadError(
            f"{path}: truncated: tensor data ends at byte {header.data_end} but the file has "
            f"{header.file_bytes} bytes ({missing / 2**20:.1f} MiB missing)"
        )
    return ModelFiles(path, "gguf", header.file_bytes, len(header.tensors), header.type_counts, gguf=header)


def _inspect_folder(path: Path) -> ModelFiles:
    artifact = (path / "mcp2026_artifact.json").is_file()
    if artifact:
        raw = dict(read_metadata(path)["model_config"])
        files = [path / WEIGHTS_FILE]
    else:
        raw = hf.read_json(path / "config.json")
        files = hf.weight_files(path)  # the loader's own rule: index.json shards, else *.safetensors
    counts: dict[str, int] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: weight file is missing")
        _merge(counts, check_safetensors(f))
    size = sum(f.stat().st_size for f in files)
    file_format = "mcp2026-artifact" if artifact else "safetensors"
    return ModelFiles(path, file_format, size, sum(counts.values()), counts, raw_config=raw)


def inspect_model(path: Path) -> ModelFiles:
    """The model's files, checked; ModelLoadError names the file and what is wrong."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    return _inspect_folder(path) if path.is_dir() else _inspect_gguf(path)


def model_config(files: ModelFiles) -> ModelConfig:
    """The ModelConfig the loader would build; UnsupportedArchitectureError / ModelLoadError otherwise."""

    if files.gguf is not None:  # parsed again as the loader does: a rope_freqs tensor's values are config
        return gguf_loading.config_from_gguf(gguf_loading.open_gguf(files.path), str(files.path))
    raw = dict(files.raw_config or {})
    if files.file_format == "safetensors":
        return hf.config_from_hf(raw, str(files.path / "config.json"))
    resolve_architecture(str(raw.get("architecture", "")), str(files.path))
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{files.path}: bad model_config in the artifact metadata ({e})") from None
