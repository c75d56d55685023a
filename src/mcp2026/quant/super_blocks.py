"""K-quant scales held as a GGUF holds them: a float factor per super-block of 256 weights, an integer per group.

A K-quant's group scale is d x sc and its offset -dmin x m, with d and dmin fp16 per super-block and sc and m
small integers per group of 16 or 32 (Q6_K's offset: -32 d x sc). Held per group in fp32 these take 2 (groups of
32, scale and offset) to 4 (groups of 16) bits a weight; held as factor and integer they take 0.375 to 1.25
(one fp32 factor per row and super-block, one byte per group). fp32 holds every product of a factor (an fp16's
11 significant bits, times a power of two) and an 8-bit integer exactly, so the kernels, computing factor x
integer, use the very scales the per-group form holds.

Packed (``tile_super_blocks``) as int8 (N/16, K/256, parts, 64 + 16 x 256/G): per 16-row tile, super-block and
part (the scales, then the offsets), the 16 rows' fp32 factors as 64 bytes, then per group the 16 rows' int8
integers (kernels/vnni_gemm.h reads this layout wherever a scales tensor is int8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

SUPER_BLOCK = 256  # weights per K-quant super-block along K


@dataclass
class SuperBlockScales:
    """scale[n, g] = scale_factor[n, g // groups_per_super_block] x scale_sub[n, g]; the offset likewise.

    Factors (N, K/256) fp32; integers (N, K/G) int8."""

    scale_factor: Tensor
    scale_sub: Tensor
    offset_factor: Tensor
    offset_sub: Tensor

    @property
    def groups_per_super_block(self) -> int:
        return self.scale_sub.shape[1] // self.scale_factor.shape[1]

    def expand(self) -> tuple[Tensor, Tensor]:
        """The per-group (N, K/G) fp32 scales and offsets."""
        per = self.groups_per_super_block
        scale = self.scale_factor.repeat_interleave(per, dim=1) * self.scale_sub.float()
        offset = self.offset_factor.repeat_interleave(per, dim=1) * self.offset_sub.float()
        return scale, offset

    def _map(self, fn: Callable[[Tensor], Tensor]) -> SuperBlockScales:  # fn on every field
        return SuperBlockScales(
            *(fn(t) for t in (self.scale_factor, self.scale_sub, self.offset_factor, self.offset_sub))
        )

    def rows(self, index: Tensor) -> SuperBlockScales:
        return self._map(lambda t: torch.index_select(t, 0, index))

    def row_range(self, start: int, end: int) -> SuperBlockScales:
        return self._map(lambda t: t[start:end])

    def regrouped(self, repeat: int) -> SuperBlockScales:
        """Each group split into ``repeat`` (the integers repeated; the factors stay per super-block)."""
        return SuperBlockScales(
            self.scale_factor,
            self.scale_sub.repeat_interleave(repeat, dim=1),
            self.offset_factor,
            self.offset_sub.repeat_interleave(repeat, dim=1),
        )

    def scaled(self, factor: float) -> SuperBlockScales | None:
        """The factors times ``factor`` where that keeps every product exact (a power of two); else None (the
        weight keeps its per-group scales, scaled as floats)."""
        if factor == 0 or math.frexp(abs(factor))[0] != 0.5:
            return None
        return SuperBlockScales(
            self.scale_factor * factor, self.scale_sub, self.offset_factor * factor, self.offset_sub
        )

    @staticmethod
    def concat(parts: Sequence[SuperBlockScales]) -> SuperBlockScales:
        """Rows of several (all with the same groups per super-block) as one."""
        return SuperBlockScales(
            *(
                torch.cat([getattr(p, f) for p in parts])
                for f in ("scale_factor", "scale_sub", "offset_factor", "offset_sub")
            )
        )


def tile_super_blocks(scales: SuperBlockScales, parts: int, tile: int) -> Tensor:
    """The packed int8 (N/tile, K/256, parts, tile x (4 + groups per super-block)) layout (module docstring);
    parts 1: the scales alone (a symmetric weight), 2: scales then offsets."""
    n, supers = scales.scale_factor.shape
    per = scales.groups_per_super_block

    def part(factor: Tensor, sub: Tensor) -> Tensor:
        f = factor.float().reshape(n // tile, tile, supers).transpose(1, 2).contiguous()  # (T, S, tile)
        s = sub.reshape(n // tile, tile, supers, per).permute(0, 2, 3, 1)  # (T, S, per, tile)
        return torch.cat([f.view(torch.int8), s.reshape(n // tile, supers, per * tile)], dim=2)

    tiled = [part(scales.scale_factor, scales.scale_sub)]
    if parts == 2:
        tiled.append(part(scales.offset_factor, scales.offset_sub))
    return torch.stack(tiled, dim=2).contiguous()


def expand_tiles(packed: Tensor, group_size: int) -> Tensor:
    """A packed (T, K/256, parts, tile x (4 + per)) layout -> the per-group tiled (T, K/G, parts, tile) fp32
    scales (and offsets)."""
    t, supers, parts, width = packed.shape
    per = SUPER_BLOCK // group_size
    tile = width // (4 + per)
    factor = packed[..., : 4 * tile].contiguous().view(torch.float32)  # (T, S, P, tile)
    sub = packed[..., 4 * tile :].reshape(t, supers, parts, per, tile).float()
    per_group = factor.unsqueeze(3) * sub  # (T, S, P, per, tile)
    return per_group.transpose(2, 3).reshape(t, supers * per, parts, tile)
