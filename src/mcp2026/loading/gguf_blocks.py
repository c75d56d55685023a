"""GGUF block formats read into ``BlockWeights`` (``scale * u + offset`` per group), without a float copy.

Each reader follows the byte layout of its ggml type (as the ``gguf`` package's dequantizers do) and returns the
same values they compute: u the stored unsigned integer (IQ4's levels plus 128), scale and offset in fp32 per group
of 32 (16 for Q2_K, Q3_K and Q6_K); the K-quants' and IQ4_XS's also as they store them, a factor per super-block
and an integer per group (``SuperBlockScales``).
The tests hold every format against ``gguf.quants.dequantize`` element for element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mcp2026.quant import block_linear
from mcp2026.quant.block_linear import BlockWeights, RowParts
from mcp2026.quant.super_blocks import SuperBlockScales

QK = 32  # weights per block of the simple formats
QK_K = 256  # weights per super-block of the K-quants

# u (B, n), scale (B, groups), offset (B, groups); the super-block formats add (scale factor (B, 1), scale
# integers (B, groups), offset factor (B, 1), offset integers (B, groups))
Parts = tuple[np.ndarray, ...]


def _super(
    scale_factor: np.ndarray, scale_sub: np.ndarray, offset_factor: np.ndarray, offset_sub: np.ndarray
) -> tuple[np.ndarray, ...]:
    return scale_factor, scale_sub.astype(np.int8), offset_factor, offset_sub.astype(np.int8)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(B, 16) bytes -> (B, 32) values: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(B, 4) bytes of a little-endian uint32 -> (B, 32): bit i of it, as 16 (the fifth bit of element i)."""
    bits = np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q4_0(b: np.ndarray) -> Parts:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> Parts:
    return _nibbles(b[:, 4:20]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Parts:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6]), d, -16 * d


def _q5_1(b: np.ndarray) -> Parts:
    return _nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Parts:
    d = _f16(b[:, :2])
    u = b[:, 2:34] ^ np.uint8(0x80)  # int8 q + 128 as a byte: its sign bit flipped (no 16-bit temporaries)
    return u, d, -128 * d


_TWO_BIT_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K/Q5_K super-block -> its 8 six-bit scales and 8 six-bit mins."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """(B, 128) bytes -> (B, 8, 32): each 32 bytes hold sub-block 2c in their low nibbles, 2c + 1 in the high."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> Parts:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return _k_low_nibbles(b[:, 16:144]).reshape(-1, QK_K), d * sc, -(dmin * mn), _super(d, sc, -dmin, mn)


def _q5_k(b: np.ndarray) -> Parts:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    u = _k_low_nibbles(b[:, 48:176]) | ((qh & 1) << 4)
    return u.reshape(-1, QK_K), d * sc, -(dmin * mn), _super(d, sc, -dmin, mn)


def _q2_k(b: np.ndarray) -> Parts:
    sc = b[:, :16]  # per 16 weights: scale in the low nibble, min in the high one
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    # 2-bit values by (half, shift, 32): that is the sub-blocks' order
    u = (b[:, 16:80].reshape(-1, 2, 1, 32) >> _TWO_BIT_SHIFTS) & 0x03
    scale_sub, offset_sub = (sc & 0x0F).astype(np.float32), (sc >> 4).astype(np.float32)
    return u.reshape(-1, QK_K), d * scale_sub, -(dmin * offset_sub), _super(d, scale_sub, -dmin, offset_sub)


def _q3_k(b: np.ndarray) -> Parts:
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    high = packed[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    sc = ((low.reshape(-1, 16) & 0x0F) | ((high.reshape(-1, 16) & 0x03) << 4)).astype(np.float32) - 32
    q = (qs.reshape(-1, 2, 1, 32) >> _TWO_BIT_SHIFTS) & 0x03
    # a set mask bit is the value as stored, a clear one subtracts 4: u = q + 4 * bit, offset -4
    bit = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    u = q.reshape(-1, 8, 32) | (bit << 2)
    scale = d * sc
    return u.reshape(-1, QK_K), scale, -4 * scale, _super(d, sc, -4 * d, sc)


# IQ4_NL's and IQ4_XS's 16 non-uniform levels plus 128 (unsigned bytes, offset -128 scale); BlockLinear holds
# them as 4-bit indices into this table
_IQ4_LEVELS = np.array(block_linear.LEVEL_VALUES, dtype=np.uint8)


def _iq4_nl(b: np.ndarray) -> Parts:
    d = _f16(b[:, :2])
    return _IQ4_LEVELS[_nibbles(b[:, 2:18])], d, -128 * d


def _iq4_xs(b: np.ndarray) -> Parts:
    d = _f16(b[:, :2])
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)
    low = b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)
    sc = ((low.reshape(-1, 8) & 0x0F) | ((high & 0x03).astype(np.uint8) << 4)).astype(np.float32) - 32
    u = _IQ4_LEVELS[_nibbles(b[:, 8:136].reshape(-1, 16)).reshape(-1, QK_K)]
    scale = d * sc
    return u, scale, -128 * scale, _super(d, sc, -128 * d, sc)


def _q6_k(b: np.ndarray) -> Parts:
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> _TWO_BIT_SHIFTS) & 0x03
    u = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)
    scale = d * sc  # (B, 16): one per 16 weights
    return u.reshape(-1, QK_K), scale, -32 * scale, _super(d, sc, -32 * d, sc)


@dataclass(frozen=True)
class BlockFormat:
    block_bytes: int  # bytes per stored block
    group_size: int  # weights per scale and offset
    # the widest stored value (4: nibble tiles, Q2_K's and Q3_K's values too; 5: nibbles and a plane of fifth
    # bits; 6: and a plane of sixth bits; 8: bytes)
    bits: int
    read: Callable[[np.ndarray], Parts]
    center: int | None = None  # symmetric formats: every offset is -center x scale (BlockWeights.center)
    super_blocks: bool = False  # its reader gives the scales as stored too (BlockWeights.super_blocks)


# ggml type name -> how to read it. Types not here (IQ1-IQ3, TQ*: codebook grids) have no exact kernel form yet.
BLOCK_FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat(18, 32, 4, _q4_0, center=8),
    "Q4_1": BlockFormat(20, 32, 4, _q4_1),
    "Q5_0": BlockFormat(22, 32, 5, _q5_0, center=16),
    "Q5_1": BlockFormat(24, 32, 5, _q5_1),
    "Q8_0": BlockFormat(34, 32, 8, _q8_0, center=128),
    "Q4_K": BlockFormat(144, 32, 4, _q4_k, super_blocks=True),
    "Q5_K": BlockFormat(176, 32, 5, _q5_k, super_blocks=True),
    "Q6_K": BlockFormat(210, 16, 6, _q6_k, center=32, super_blocks=True),
    "Q2_K": BlockFormat(84, 16, 4, _q2_k, super_blocks=True),
    "Q3_K": BlockFormat(110, 16, 4, _q3_k, center=4, super_blocks=True),
    "IQ4_NL": BlockFormat(18, 32, 8, _iq4_nl, center=128),
    "IQ4_XS": BlockFormat(136, 32, 8, _iq4_xs, center=128, super_blocks=True),
}


def read_blocks(raw: np.ndarray, type_name: str) -> BlockWeights:
    """A 2-D tensor's bytes (rows, bytes per row), stored as ``type_name``, as BlockWeights."""
    fmt = BLOCK_FORMATS[type_name]
    rows = raw.shape[0]
    u, scale, offset, *supers = fmt.read(np.asarray(raw).reshape(-1, fmt.block_bytes))
    k = u.size // rows

    def tensor(a: np.ndarray, cols: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a).reshape(rows, cols))

    groups = k // fmt.group_size
    super_blocks = None
    if supers:
        scale_factor, scale_sub, offset_factor, offset_sub = supers[0]
        super_blocks = SuperBlockScales(
            tensor(scale_factor, k // QK_K),
            tensor(scale_sub, groups),
            tensor(offset_factor, k // QK_K),
            tensor(offset_sub, groups),
        )
    return BlockWeights(
        tensor(u, k),
        tensor(scale, groups),
        tensor(offset, groups),
        fmt.group_size,
        fmt.bits,
        (type_name,),
        fmt.center,
        super_blocks,
    )


def read_block_rows(
    read_rows: Callable[[int, int], np.ndarray], type_name: str, shape: torch.Size, rows: int | None = None
) -> RowParts:
    """Like ``read_blocks``, but ``rows`` rows at a time (``block_linear.PACK_ROWS`` by default;
    ``read_rows(start, end)`` gives their bytes) as the packer asks for them: the whole weight is never unpacked
    at once (for a token table, a byte per weight of the whole vocabulary)."""
    fmt = BLOCK_FORMATS[type_name]
    n, step = shape[0], rows or block_linear.PACK_ROWS
    parts = (read_blocks(read_rows(a, min(a + step, n)), type_name) for a in range(0, n, step))
    return RowParts(shape, fmt.group_size, fmt.bits, (type_name,), parts, fmt.center, fmt.super_blocks)
