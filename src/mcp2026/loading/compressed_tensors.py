"""Hugging Face folders in the compressed-tensors format (``quantization_config.quant_method`` =
"compressed-tensors", as llm-compressor and ``mcp2026 compile --export compressed-tensors`` write them): int4 /
int8 "pack-quantized" linears read into ``BlockWeights`` (w = scale * u + offset per group, exactly), fp8
"float-quantized" ones into floats; and the int32 packing both directions use.

Packing: value v of B bits is stored as v + 2^(B-1), element i of a row at bit i * B of the row's int32 words
(little-endian; 8 int4 or 4 int8 per word). Zero points are packed the same way along the output dimension.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mcp2026.errors import ModelLoadError
from mcp2026.quant.block_linear import BLOCK, BlockWeights, packable

QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"
# the tensors a compressed linear holds in place of "weight"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def compression_of(raw_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """A config.json's compressed-tensors quantization_config, or None when it has none."""
    quant = raw_config.get("quantization_config") or {}
    return quant if quant.get("quant_method") == QUANT_METHOD else None


def is_compressed_folder(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face folder whose config.json names compressed-tensors quantization."""
    config = Path(path) / "config.json"
    try:
        return config.is_file() and compression_of(json.loads(config.read_text())) is not None
    except (OSError, ValueError):
        return False


def pack_int32(values: Tensor, num_bits: int, dim: int = 1) -> Tensor:
    """Signed values (int) of ``num_bits`` (4 or 8) -> int32 words along ``dim`` (0 or 1)."""
    per_word = 32 // num_bits
    v = (values.to(torch.int64) + (1 << (num_bits - 1))).clamp(0, (1 << num_bits) - 1)
    v = v if dim == 1 else v.t()
    rows, cols = v.shape
    padded = -(-cols // per_word) * per_word
    v = torch.nn.functional.pad(v, (0, padded - cols)).view(rows, -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    words = (v << shifts).sum(-1)  # (rows, words), each < 2^32
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return (words if dim == 1 else words.t()).contiguous()


def unpack_int32(words: Tensor, num_bits: int, length: int, dim: int = 1) -> Tensor:
    """Inverse of ``pack_int32``: the unsigned stored values (value + 2^(B-1)), ``length`` along ``dim``, uint8."""
    per_word = 32 // num_bits
    w = (words if dim == 1 else words.t()).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    u = ((w.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)).reshape(w.shape[0], -1)[:, :length]
    u = u.to(torch.uint8)
    return (u if dim == 1 else u.t()).contiguous()


def _scheme(quant: Mapping[str, Any], module: str) -> dict[str, Any]:
    """The weights scheme and format of the config group targeting ``module`` (by exact name, regex or Linear)."""
    for group in (quant.get("config_groups") or {}).values():
        for target in group.get("targets", []):
            matched = (
                re.match(target.removeprefix("re:"), module) is not None
                if target.startswith("re:")
                else target in (module, "Linear")
            )
            if matched:
                fmt = group.get("format") or quant.get("format")
                return {**(group.get("weights") or {}), "format": fmt}
    raise ModelLoadError(
        f"compressed-tensors: no config group targets {module}, which holds quantized tensors"
    )


def _int_blocks(module: str, parts: Mapping[str, Tensor], scheme: Mapping[str, Any]) -> BlockWeights:
    bits = int(scheme.get("num_bits", 0))
    strategy = scheme.get("strategy")
    if bits not in (4, 8) or strategy not in ("group", "channel"):
        raise ModelLoadError(
            f"{module}: compressed-tensors {bits}-bit {strategy} weights are not supported (mcp2026 reads int4 and "
            "int8 per group or per channel)"
        )
    n, k = (int(d) for d in parts["weight_shape"].tolist())
    u = unpack_int32(parts["weight_packed"], bits, k)  # (N, K): q + 2^(B-1)
    scale = parts["weight_scale"].float()  # (N, G)
    group = k // scale.shape[1]
    zero_point = torch.zeros_like(scale)
    symmetric = scheme.get("symmetric", True)
    if not symmetric:
        zero_point = unpack_int32(parts["weight_zero_point"], bits, n, dim=0).float() - (1 << (bits - 1))
    offset = -((1 << (bits - 1)) + zero_point) * scale  # w = (q - zp) * s = s * u - (2^(B-1) + zp) * s
    if group % BLOCK:
        raise ModelLoadError(
            f"{module}: groups of {group} weights are not supported (a multiple of {BLOCK} is)"
        )
    # symmetric: every offset is -2^(B-1) x scale, so the packing keeps the scales alone
    blocks = BlockWeights(
        u, scale, offset, group, bits, (f"int{bits}",), 1 << (bits - 1) if symmetric else None
    )
    return blocks.regrouped(BLOCK)


def read_compressed(
    module: str, parts: Mapping[str, Tensor], quant: Mapping[str, Any], native: bool, dtype: torch.dtype
) -> Tensor | BlockWeights:
    """One compressed linear's weight: stored blocks when ``native`` and the GEMM takes the shape, else floats."""
    scheme = _scheme(quant, module)
    if scheme["format"] == FLOAT_QUANTIZED:
        return (parts["weight"].float() * parts["weight_scale"].float()).to(dtype)
    if scheme["format"] != PACK_QUANTIZED or scheme.get("type", "int") != "int":
        raise ModelLoadError(
            f"{module}: compressed-tensors format {scheme['format']!r} is not supported (mcp2026 reads "
            f"{PACK_QUANTIZED} and {FLOAT_QUANTIZED})"
        )
    blocks = _int_blocks(module, parts, scheme)
    return blocks if native and packable(blocks.shape) else blocks.dequantize().to(dtype)
