"""Linears and embeddings that run a file's stored block quantization as it is (GGUF Q4_0 ... Q8_0, K-quants).

Every GGUF block format is ``w = scale * u + offset`` per group of 16 or 32 weights, with u a small unsigned
integer and float scale and offset (Q4_1: u the nibble, scale d, offset m; Q8_0: u = q + 128, offset -128 d;
Q4_K: scale d * sc, offset -dmin * m; ...). ``BlockWeights`` holds that form, exactly: fp32 holds every product
of a float16 super-block scale and a 6- or 8-bit sub-scale. ``BlockLinear`` packs it for our block GEMM
(kernels/block_gemm.cpp: AVX-512 VNNI, AVX2, or a scalar loop): 4-bit values into nibble tiles, 5- and 6-bit ones
into nibble tiles with planes of their high bits, wider ones into byte tiles, all with a scale and offset per group
(fp16 where that holds them all exactly, as for Q4_0 / Q4_1 / Q8_0; the K-quants' as they store them, a factor per
super-block and an integer per group: ``super_blocks``), so the only rounding added is the activations' int8 per
32 values that every int8 dot product here (and llama.cpp's) makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from mcp2026 import hardware
from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.super_blocks import SUPER_BLOCK, SuperBlockScales, expand_tiles, tile_super_blocks

COLUMN_TILE = 16  # output rows per packed tile (kernels/vnni_gemm.h kColTile)
BLOCK = 32  # activation quantization block; every group divides or equals it
GROUP_SIZES = (16, 32)


@dataclass
class BlockWeights:
    """An (N, K) weight as ``scale * u + offset`` per group of ``group_size`` along K.

    u: (N, K) uint8; scale, offset: (N, K / group_size) fp32; bits: the widest value u holds (4, 5, 6 or 8, which
    picks the packed layout); formats: the stored types it came from (for reports); center: set where every
    offset is -center x scale (the symmetric formats: Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, IQ4), so the packing keeps
    the scales alone; super_blocks: the same scales and offsets as the K-quants store them (a factor per 256
    weights, an integer per group), which the packing keeps instead of a float per group."""

    u: Tensor
    scale: Tensor
    offset: Tensor
    group_size: int
    bits: int
    formats: tuple[str, ...]
    center: int | None = None
    super_blocks: SuperBlockScales | None = None

    @property
    def shape(self) -> torch.Size:
        return self.u.shape

    def dequantize(self) -> Tensor:
        """The fp32 (N, K) weight, as the file's own dequantization computes it."""
        n, k = self.u.shape
        g = self.group_size
        w = self.u.float().view(n, k // g, g) * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return w.view(n, k)

    def rows(self, index: Tensor) -> BlockWeights:
        def take(t: Tensor) -> Tensor:
            return torch.index_select(t, 0, index)

        supers = self.super_blocks
        return replace(
            self,
            u=take(self.u),
            scale=take(self.scale),
            offset=take(self.offset),
            super_blocks=None if supers is None else supers.rows(index),
        )

    def scaled(self, factor: float) -> BlockWeights:
        """The weight times ``factor`` (scale and offset scaled; u unchanged)."""
        supers = self.super_blocks
        return replace(
            self,
            scale=self.scale * factor,
            offset=self.offset * factor,
            super_blocks=None if supers is None else supers.scaled(factor),
        )

    def regrouped(self, group_size: int) -> BlockWeights:
        """The same weight with groups of ``group_size`` (a divisor of this one's): parameters repeated."""
        if group_size == self.group_size:
            return self
        repeat = self.group_size // group_size
        supers = self.super_blocks
        return replace(
            self,
            scale=self.scale.repeat_interleave(repeat, dim=1),
            offset=self.offset.repeat_interleave(repeat, dim=1),
            group_size=group_size,
            super_blocks=None if supers is None else supers.regrouped(repeat),
        )

    def row_parts(self, rows: int | None = None) -> RowParts:
        """This weight as consecutive parts of ``rows`` rows (``PACK_ROWS`` by default; whole 16-row tiles)."""
        step = rows or PACK_ROWS
        if step % COLUMN_TILE:
            raise ValueError(f"parts are whole tiles: rows in {COLUMN_TILE}s, got {step}")
        n = self.u.shape[0]

        def parts() -> Iterator[BlockWeights]:
            supers = self.super_blocks
            for a in range(0, n, step):
                b = min(a + step, n)
                yield replace(
                    self,
                    u=self.u[a:b],
                    scale=self.scale[a:b],
                    offset=self.offset[a:b],
                    super_blocks=None if supers is None else supers.row_range(a, b),
                )

        return RowParts(
            self.shape,
            self.group_size,
            self.bits,
            self.formats,
            parts(),
            self.center,
            self.super_blocks is not None,
        )

    @staticmethod
    def concat(parts: Sequence[BlockWeights]) -> BlockWeights:
        """Rows of several weights as one (a fused qkv or gate/up): the finest grouping and widest values of
        the parts, so a mix (Q4_K q and k with a Q6_K v) stays exact."""
        group = min(p.group_size for p in parts)
        parts = [p.regrouped(group) for p in parts]
        formats = tuple(dict.fromkeys(f for p in parts for f in p.formats))
        centers = {p.center for p in parts}
        supers = [p.super_blocks for p in parts if p.super_blocks is not None]
        return BlockWeights(
            torch.cat([p.u for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
            group,
            max(p.bits for p in parts),
            formats,
            centers.pop() if len(centers) == 1 else None,
            SuperBlockScales.concat(supers) if len(supers) == len(parts) else None,
        )


def packable(shape: Sequence[int]) -> bool:
    """Whether the VNNI GEMMs take an (N, K) weight: rows in tiles of 16, K in activation blocks of 32."""
    n, k = shape
    return n % COLUMN_TILE == 0 and k % BLOCK == 0


# Rows packed at a time: the packers' temporaries (a few copies of these rows) stay a few MB, where a whole token
# table's would set the load's peak memory.
PACK_ROWS = 1024


@dataclass
class RowParts:
    """An (N, K) weight's blocks as consecutive parts of whole 16-row tiles, produced one at a time (read from a
    file part by part, nothing holds the whole weight unpacked). ``bits``: the widest value of any part."""

    shape: torch.Size
    group_size: int
    bits: int
    formats: tuple[str, ...]
    parts: Iterable[BlockWeights]
    center: int | None = None  # as BlockWeights.center, for every part
    super_blocks: bool = False  # every part has BlockWeights.super_blocks


def _tiles_fp32(*per_group: Tensor) -> Tensor:
    """(N, G) scales (and offsets) -> (N/16, G, parts, 16)."""
    n, groups = per_group[0].shape
    per_tile = [t.float().reshape(n // COLUMN_TILE, COLUMN_TILE, groups).transpose(1, 2) for t in per_group]
    return torch.stack(per_tile, dim=2).contiguous()


def _narrowed(tiled: Tensor) -> Tensor:
    """fp16 where fp16 holds every value exactly (GGUF's Q4_0 / Q4_1 / Q8_0 store fp16: half the bytes), else fp32
    (a K-quant's super-block scale times its 6-bit sub-scale needs up to 17 significant bits)."""
    half = tiled.to(torch.float16)
    return half if torch.equal(half.float(), tiled) else tiled


def tile_scales(scale: Tensor, offset: Tensor | None = None) -> Tensor:
    """(N, G) scales and offsets -> (N/16, G, 2, 16): per (tile, group) the 16 rows' scales, then offsets; fp16
    where that is exact, else fp32 (``_narrowed``). Without offsets (a symmetric weight: each -value_center x its
    scale) (N/16, G, 1, 16)."""
    return _narrowed(_tiles_fp32(scale) if offset is None else _tiles_fp32(scale, offset))


# IQ4_NL's and IQ4_XS's 16 non-uniform levels (ggml's kvalues_iq4nl) plus 128: the bytes u of those formats. A
# weight made only of them is packed as 4-bit indices into this table (kernels/cpu_kernels.h kLevelValues holds
# the same), typed int8 so the kernels tell the layout from plain nibbles.
LEVEL_VALUES = (1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241)
LEVEL_FORMATS = frozenset({"IQ4_NL", "IQ4_XS"})
_LEVEL_INDEX = np.full(256, 255, dtype=np.uint8)
_LEVEL_INDEX[list(LEVEL_VALUES)] = np.arange(16, dtype=np.uint8)


def holds_levels(weight: BlockWeights | RowParts) -> bool:
    """Whether every value is one of ``LEVEL_VALUES`` by its formats (IQ4 only, groups of 32)."""
    return bool(weight.formats) and set(weight.formats) <= LEVEL_FORMATS and weight.group_size == BLOCK


def pack_level_tiles(u: Tensor) -> Tensor:
    """u (N, K), every value one of ``LEVEL_VALUES`` -> their indices laid out as ``pack_int4_tiles`` lays
    nibbles, as int8 (the kernels' mark of this layout)."""
    index = _LEVEL_INDEX[u.numpy()]
    if (index == 255).any():
        bad = int(u.numpy()[index == 255][0])
        raise ValueError(f"value {bad} is not one of the IQ4 levels {LEVEL_VALUES}")
    return pack_int4_tiles(torch.from_numpy(index)).view(torch.int8)


def value_center(bits: int, levels: bool = False) -> int:
    """The middle of a packed layout's values (kernels/cpu_kernels.h value_center): where a symmetric weight's
    scales alone are kept, each offset is -value_center x its scale."""
    return 128 if levels or bits == 8 else 2 ** (bits - 1)


def keeps_scales_alone(weight: BlockWeights | RowParts, levels: bool = False) -> bool:
    """Whether every offset is -center x scale, with the values (0 .. 2 center - 1) movable to the layout's
    center: IQ4's levels at 128 exactly; other values at or below it (``pack_row_parts`` moves them up, so Q3_K's
    0 .. 7 around 4 are held as nibbles around 8)."""
    center, middle = weight.center, value_center(weight.bits, levels)
    return center is not None and (center == middle or (center < middle and not levels))


def pack_row_parts(weight: RowParts, levels: bool = False) -> tuple[Tensor, Tensor]:
    """The packed values and tiled scales and offsets (``tile_scales``) of a weight given part by part;
    ``levels``: as indices into ``LEVEL_VALUES`` (``pack_level_tiles``). A symmetric weight
    (``keeps_scales_alone``) keeps its scales alone, (N/16, K/G, 1, 16), its values moved up to the layout's center.
    A weight with ``super_blocks`` keeps them so, int8 (N/16, K/256, 1 or 2, ...) (``tile_super_blocks``)."""
    pack = (
        pack_level_tiles
        if levels
        else {4: pack_int4_tiles, 5: pack_int5_tiles, 6: pack_int6_tiles}.get(weight.bits, pack_byte_tiles)
    )
    alone = keeps_scales_alone(weight, levels)
    shift = value_center(weight.bits, levels) - weight.center if alone else 0
    supers = weight.super_blocks and weight.shape[1] % SUPER_BLOCK == 0
    tiles = weight.shape[0] // COLUMN_TILE
    packed = scales = None
    done = 0
    for part in weight.parts:
        rows = part.u.shape[0]
        if rows % COLUMN_TILE or done * COLUMN_TILE + rows > weight.shape[0]:
            raise ValueError(
                f"a part of {rows} rows after {done * COLUMN_TILE}: parts are whole tiles of {COLUMN_TILE} rows "
                f"within the weight's {weight.shape[0]}"
            )
        if part.group_size != weight.group_size or part.bits > weight.bits:
            raise ValueError(
                f"a part of {part.bits}-bit values in groups of {part.group_size} in a weight of "
                f"{weight.bits}-bit values in groups of {weight.group_size}"
            )
        if alone and not torch.equal(part.offset, -weight.center * part.scale):
            raise ValueError(f"offsets that are not -{weight.center} x scale in a weight marked symmetric")
        values = pack(part.u + shift if shift else part.u)
        if supers:
            if part.super_blocks is None:
                raise ValueError("a part without super-block scales in a weight marked as having them")
            part_scales = tile_super_blocks(part.super_blocks, 1 if alone else 2, COLUMN_TILE)
        else:
            part_scales = _tiles_fp32(part.scale) if alone else _tiles_fp32(part.scale, part.offset)
        if packed is None or scales is None:
            packed = torch.empty((tiles, *values.shape[1:]), dtype=values.dtype)
            scales = torch.empty((tiles, *part_scales.shape[1:]), dtype=part_scales.dtype)
        end = done + rows // COLUMN_TILE
        packed[done:end], scales[done:end] = values, part_scales
        done = end
    if packed is None or scales is None or done != tiles:
        raise ValueError(f"row parts cover {done * COLUMN_TILE} of the weight's {weight.shape[0]} rows")
    return packed, scales if supers else _narrowed(scales)


# NOTE: the packing runs in numpy: its strided uint8 copies are several times faster than torch's here, and a
# model's worth of them is part of start-up.
def pack_int4_tiles(u: Tensor) -> Tensor:
    """u (N, K) in 0..15 -> the int4 GEMM's (N/16, K/8, 64) bytes: byte 4c + e of vector j of tile t holds
    u[16t + c][8j + e] in its low nibble and u[16t + c][8j + 4 + e] in its high one."""
    n, k = u.shape
    v = u.numpy().reshape(n // COLUMN_TILE, COLUMN_TILE, k // 8, 2, 4)  # (t, c, j, half, e)
    # one strided copy into the tiles' order, then the nibbles joined over contiguous halves (twice as fast as
    # joining over the strided view first)
    v = np.ascontiguousarray(v.transpose(0, 2, 3, 1, 4))  # (t, j, half, c, e)
    return torch.from_numpy((v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n // COLUMN_TILE, k // 8, 64))


def _bit_masks(bit: np.ndarray) -> np.ndarray:
    """(N, K) 0/1 -> per nibble vector two 64-bit little-endian masks (N/16, K/8, 16): bit 4c + e of the first
    for element [16t + c][8j + e], of the second for [16t + c][8j + 4 + e]."""
    n, k = bit.shape
    v = bit.reshape(n // COLUMN_TILE, COLUMN_TILE, k // 8, 2, 4)  # (t, c, j, half, e)
    planes = np.ascontiguousarray(v.transpose(0, 2, 3, 1, 4)).reshape(n // COLUMN_TILE, k // 8, 2, 64)
    return np.packbits(planes, axis=-1, bitorder="little").reshape(n // COLUMN_TILE, k // 8, 16)


def _pack_bit_plane_tiles(u: Tensor, bits: int) -> Tensor:
    """u (N, K) below 2^bits -> per vector the low four bits as ``pack_int4_tiles`` lays them out, then two masks
    (``_bit_masks``) per bit above them: (N/16, K/8, 64 + 16 (bits - 4))."""
    values = u.numpy()
    nibbles = pack_int4_tiles(u & 0x0F).numpy()  # (t, j, 64)
    masks = [_bit_masks((values >> shift) & 1) for shift in range(4, bits)]
    return torch.from_numpy(np.concatenate([nibbles, *masks], axis=-1))


def pack_int5_tiles(u: Tensor) -> Tensor:
    """u (N, K) in 0..31 -> the block GEMM's 5-bit (N/16, K/8, 80) bytes: nibbles and the fifth bits' masks."""
    return _pack_bit_plane_tiles(u, 5)


def pack_int6_tiles(u: Tensor) -> Tensor:
    """u (N, K) in 0..63 -> the block GEMM's 6-bit (N/16, K/8, 96) bytes: the 5-bit vector, then the sixth bits'
    masks."""
    return _pack_bit_plane_tiles(u, 6)


def pack_byte_tiles(u: Tensor) -> Tensor:
    """u (N, K) bytes -> the block GEMM's (N/16, K/4, 64): byte 4c + e of vector j of tile t is u[16t + c][4j + e]."""
    n, k = u.shape
    v = u.numpy().reshape(n // COLUMN_TILE, COLUMN_TILE, k // 4, 4)  # (t, c, j, e)
    return torch.from_numpy(
        np.ascontiguousarray(v.transpose(0, 2, 1, 3)).reshape(n // COLUMN_TILE, k // 4, 64)
    )


def kernels_unavailable() -> str | None:
    """Why stored blocks cannot run here (None: they can): they need the compiled CPU kernels."""
    if kernel_ops.cpu.load() is None:
        return f"the compiled CPU kernels are unavailable ({kernel_ops.cpu.unavailable_reason()})"
    return None


def block_kernel() -> str:
    """Which code the block GEMM runs on this CPU (the compiled kernels must be loaded)."""
    module = kernel_ops.cpu.load()
    if module is not None and kernel_ops.has_vnni_gemm(module):
        return "block_gemm (AVX-512 VNNI)"
    return "block_gemm (AVX2)" if "avx2" in hardware.cpu_flags() else "block_gemm (scalar)"


class BlockLinear(nn.Module):
    """y = x @ W.T (+ bias) with W held as a file stored it (``BlockWeights``), packed for our VNNI GEMMs.

    ``weight`` is the packed values ((N/16, K/8, 64) nibbles, (N/16, K/8, 80) 5-bit or (N/16, K/8, 96) 6-bit
    values, (N/16, K/4, 64) bytes, or IQ4's levels as (N/16, K/8, 64) int8 nibbles of indices: ``levels``),
    ``scales_offsets`` (N/16, K/G, 2, 16), or (N/16, K/G, 1, 16) for a symmetric weight (``keeps_scales_alone``),
    fp16 where that is exact (``tile_scales``), else fp32; a K-quant's as it stores them, int8 (N/16, K/256, 1 or
    2, ...) (``super_blocks.tile_super_blocks``). Runs on the compiled kernels only (the loader checks they are
    there)."""

    def __init__(self, blocks: BlockWeights | RowParts, bias: Tensor | None = None) -> None:
        super().__init__()
        weight = blocks if isinstance(blocks, RowParts) else blocks.row_parts()
        n, k = weight.shape
        if not packable((n, k)):
            raise ValueError(f"a ({n}, {k}) weight does not fit the GEMM tiles (rows in 16s, K in 32s)")
        if weight.group_size not in GROUP_SIZES:
            raise ValueError(f"groups of {weight.group_size} have no kernel (groups of {GROUP_SIZES})")
        self.in_features, self.out_features = k, n
        levels = holds_levels(weight)
        self.bits = 4 if levels else weight.bits  # the bits each value is held in
        self.group_size, self.formats = weight.group_size, weight.formats
        packed, scales_offsets = pack_row_parts(weight, levels)
        self.register_buffer("weight", packed)
        self.register_buffer("scales_offsets", scales_offsets)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    @property
    def shape(self) -> torch.Size:
        """(N, K): the weight's shape, as BlockWeights gives it (the loader checks shapes of either)."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def levels(self) -> bool:
        """Whether the values are IQ4 level indices (``pack_level_tiles``: the packed buffer is typed int8)."""
        return self.weight.dtype == torch.int8

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight: the values plus the scales (and offsets), per group or per super-block."""
        so = self.scales_offsets
        return self.bits + 8 * so.numel() * so.element_size() / (self.in_features * self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, x: Tensor) -> Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        kernels = kernel_ops.kernels_for(x2)
        if kernels is None:
            raise RuntimeError(
                "BlockLinear runs on the compiled CPU kernels only (CPU fp32/bf16 input, no autograd); load "
                "the model with dtype='fp32' or 'bf16' to run it as floats"
            )
        y = kernels.block_gemm(x2, self.weight, self.scales_offsets, self.bias)  # bias added before rounding
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def dequantize_rows(self, rows: Tensor) -> Tensor:
        """fp32 (len(rows), K): the weight rows ``rows`` (an embedding lookup reads the table this way)."""
        tile, col = rows // COLUMN_TILE, rows % COLUMN_TILE
        t, picked = rows.numel(), torch.arange(rows.numel())
        # NOTE: index_select, not weight[tile]: advanced indexing of a uint8 tensor this size takes milliseconds
        packed = torch.index_select(self.weight.view(torch.uint8), 0, tile)  # (T, K/8 or K/4, 64, 80 or 96)
        per_col = packed[..., :64].reshape(t, packed.shape[1], COLUMN_TILE, 4)[picked, :, col]  # (T, J, 4)
        if self.bits == 8:
            u = per_col.reshape(t, self.in_features)
        else:
            halves = torch.stack([per_col & 0xF, per_col >> 4], dim=2)  # (T, J, 2, 4)
            # the fifth (and sixth) bits of column c: bits 4c .. 4c + 3 of each mask
            for plane in range(self.bits - 4):
                start = 64 + 16 * plane
                masks = packed[..., start : start + 16].reshape(t, packed.shape[1], 2, 8)[
                    picked, :, :, col // 2
                ]  # (T, J, 2)
                shift = (4 * (col % 2)).view(t, 1, 1, 1) + torch.arange(4)
                bit = ((masks.unsqueeze(-1).long() >> shift) & 1) << (4 + plane)
                halves = halves | bit.to(halves.dtype)
            u = halves.reshape(t, self.in_features)
            if self.levels:
                u = torch.tensor(LEVEL_VALUES, dtype=torch.uint8)[u.long()]
        so = torch.index_select(self.scales_offsets, 0, tile)
        if so.dtype == torch.int8:
            so = expand_tiles(so, self.group_size)
        so = so[picked, :, :, col].float()  # (T, K/G, 1 or 2)
        g = self.group_size
        scale = so[..., 0:1]
        offset = so[..., 1:2] if so.shape[-1] == 2 else -value_center(self.bits, self.levels) * scale
        w = u.float().view(t, -1, g) * scale + offset
        return w.view(t, self.in_features)

    def dequantize(self) -> Tensor:
        """The fp32 (N, K) weight this module computes with (before the activations' rounding)."""
        return self.dequantize_rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        stored = "+".join(self.formats)
        held = "4-bit level indices" if self.levels else f"{self.bits}-bit"
        return f"{self.in_features}, {self.out_features}, {stored} as {held} g{self.group_size}"


class BlockEmbedding(nn.Module):
    """A token embedding whose table is a ``BlockLinear`` (the lm_head's own when the two are tied): a lookup
    dequantizes only the rows it reads."""

    def __init__(self, table: BlockLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: Tensor) -> Tensor:
        kernels, t = kernel_ops.cpu.load(), self.table
        if kernels is None:
            raise RuntimeError("BlockEmbedding runs on the compiled CPU kernels only, as its table does")
        # the compiled lookup computes dequantize_rows's values (one call: a decode step reads one row); an id
        # outside the vocabulary is an IndexError saying so
        flat = ids.reshape(-1)
        rows = kernels.block_weight_rows(
            t.weight, t.scales_offsets, t.in_features, flat if flat.dtype == torch.long else flat.long()
        )
        rows = rows if rows.dtype == self.dtype else rows.to(self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.dtype}"
