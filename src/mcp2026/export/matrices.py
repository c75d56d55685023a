"""A linear's weight as an exporter sees it: the quantized values and their scales, taken off our modules as they
are (never re-quantized), with the row operations un-fusing needs (row selection, a factor on every value)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mcp2026.errors import ExportError
from mcp2026.quant.block_linear import BlockEmbedding, BlockLinear
from mcp2026.quant.dense_linear import DenseLinear
from mcp2026.quant.fp8_linear import Fp8Linear
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int4_packing import unpack_int4
from mcp2026.quant.int8_group_linear import Int8GroupLinear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import dequantize_groupwise_int8


@dataclass(frozen=True)
class FloatMatrix:
    """An (N, K) float weight, in the dtype the model holds it."""

    weight: Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def rows(self, index: Tensor) -> FloatMatrix:
        return FloatMatrix(self.weight.index_select(0, index))

    def scaled(self, factor: float) -> FloatMatrix:
        return FloatMatrix((self.weight.float() * factor).to(self.weight.dtype))

    def dequantize(self) -> Tensor:
        return self.weight.float()


@dataclass(frozen=True)
class StoredBlocks:
    """A weight a GGUF file stored in blocks and the model runs as stored (``BlockLinear``): its fp32 values,
    which an exporter matches against the source file's tensor to write that tensor's bytes back."""

    weight: Tensor  # (N, K) fp32
    formats: tuple[str, ...]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def rows(self, index: Tensor) -> StoredBlocks:
        return StoredBlocks(self.weight.index_select(0, index), self.formats)

    def scaled(self, factor: float) -> StoredBlocks:
        return StoredBlocks(self.weight * factor, self.formats)

    def dequantize(self) -> Tensor:
        return self.weight


@dataclass(frozen=True)
class Int8Rows:
    """Symmetric int8 per output row, w = q * scale[:, None], or per group of 32 along K (Q8_0's form): w = q *
    scale[:, k // 32]."""

    q: Tensor  # (N, K) int8
    scale: Tensor  # (N,) or (N, K / 32) fp32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, index: Tensor) -> Int8Rows:
        return Int8Rows(self.q.index_select(0, index), self.scale.index_select(0, index))

    def scaled(self, factor: float) -> Int8Rows:
        return Int8Rows(self.q, self.scale * factor)

    @property
    def grouped(self) -> bool:
        return self.scale.dim() == 2

    def dequantize(self) -> Tensor:
        if self.grouped:
            return dequantize_groupwise_int8(self.q, self.scale)
        return self.q.float() * self.scale[:, None]


@dataclass(frozen=True)
class Int4Groups:
    """int4 per group of ``group_size`` along K, our kernel's convention: w = (u - 8) * scale + zero."""

    u: Tensor  # (N, K) uint8 in 0..15
    scale: Tensor  # (N, K / group_size) fp32
    zero: Tensor  # (N, K / group_size) fp32
    group_size: int

    @property
    def symmetric(self) -> bool:
        return bool((self.zero == 0).all())

    @property
    def shape(self) -> torch.Size:
        return self.u.shape

    def rows(self, index: Tensor) -> Int4Groups:
        def take(t: Tensor) -> Tensor:
            return t.index_select(0, index)

        return Int4Groups(take(self.u), take(self.scale), take(self.zero), self.group_size)

    def scaled(self, factor: float) -> Int4Groups:
        return Int4Groups(self.u, self.scale * factor, self.zero * factor, self.group_size)

    def dequantize(self) -> Tensor:
        n, k = self.u.shape
        groups = (self.u.float() - 8).view(n, -1, self.group_size)  # (N, G, g)
        w = groups * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.view(n, k)


@dataclass(frozen=True)
class Fp8Rows:
    """e4m3 per output row: w = weight * scale[:, None]."""

    weight: Tensor  # (N, K) float8_e4m3fn
    scale: Tensor  # (N,) fp32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def rows(self, index: Tensor) -> Fp8Rows:
        return Fp8Rows(self.weight.index_select(0, index), self.scale.index_select(0, index))

    def scaled(self, factor: float) -> Fp8Rows:
        return Fp8Rows(self.weight, self.scale * factor)

    def dequantize(self) -> Tensor:
        return self.weight.float() * self.scale[:, None]


Matrix = FloatMatrix | StoredBlocks | Int8Rows | Int4Groups | Fp8Rows


def matrix_of(name: str, module: nn.Module) -> Matrix:
    """The weight of the linear ``name`` as stored; a layout no single tensor holds is an error naming it."""
    if isinstance(module, QuantLinear) and module.inv_act_scale is not None:
        raise ExportError(
            f"{name}: {module.spec.describe()} divides its input by an activation scale, which an exported "
            "tensor cannot carry; compile without AWQ (dqg: precompensation: none) to export"
        )
    if isinstance(module, DenseLinear):
        return FloatMatrix(module.weight.detach())
    if isinstance(module, Int8Linear):
        return Int8Rows(module.weight.detach(), module.scales.detach().float())
    if isinstance(module, Int4Linear):
        u = unpack_int4(module.weight.detach(), module.out_features, module.in_features)
        scale, zero = module.grids().detach().float().unbind(-1)  # (K/g, N) each
        return Int4Groups(
            u.to(torch.uint8), scale.t().contiguous(), zero.t().contiguous(), module.spec.group_size
        )
    if isinstance(module, Int8GroupLinear):
        return Int8Rows(module.weight.detach(), module.scales.detach().float())
    if isinstance(module, Fp8Linear):
        return Fp8Rows(module.weight.detach(), module.weight_scale.detach().float().reshape(-1))
    if isinstance(module, QuantLinear):  # a split layer: int8 rows inside int4
        raise ExportError(
            f"{name}: {module.spec.describe()} keeps some rows in int8 and the rest in int4, and an exported "
            "tensor has one type; compile this layer without high_rows (e.g. plain int8 or int4 g32)"
        )
    if isinstance(module, BlockLinear):
        return StoredBlocks(module.dequantize(), module.formats)
    if isinstance(module, BlockEmbedding):
        return StoredBlocks(module.table.dequantize(), module.table.formats)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return FloatMatrix(module.weight.detach())
    raise ExportError(f"{name}: a {type(module).__name__} has no export form")


def bias_of(module: nn.Module) -> Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().float()
