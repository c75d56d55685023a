"""KV codecs: how K and V are stored in the paged pool (quantized on write, dequantized on read).

A ``KVCodec`` pairs a key and a value ``TensorCodec``. Each tensor codec stores a chunk (one head of one block:
``block_size`` tokens x ``head_dim``) as named planes (data, scales, zero points). Per-token codecs (identity,
int8, fp8) encode each (token, head) row on its own, so tokens are written as they are computed. KIVI's
per-channel keys (Liu et al. 2024, arXiv:2402.02750) need a whole group of tokens per channel: the group is one
block, and a request's last, not yet full block lives in a full-precision staging store until it fills
(``KVCodec.is_staged``; see ``kv.paged_cache``). Per-token codecs keep fp16 scales and zero points, rounded so
that every value maps inside the integer range (error <= scale / 2). The int4 block codecs store theirs as
uint8 codes over three fp16 numbers per chunk (two levels, as llama.cpp's k-quants): at 16-token blocks fp16
scales and zeros cost as much as a quarter of the 4-bit data, codes half that. The bound is still half a step,
but the code grids are shared by the chunk: a group's step is rounded up by at most 1/254 of the chunk's
largest step and its zero lowered by at most 1/255 of the spread of the chunk's minima, so an outlier coarsens
the rest of its chunk a little (measured on SmolLM2: docs/kv-cache.md), and one non-finite value spoils the
whole chunk rather than one group.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcp2026.config import DEFAULT_BLOCK_SIZE

Planes = dict[str, torch.Tensor]
_FP16_TINY = 2.0**-14  # smallest normal fp16: the floor of every scale


@dataclass(frozen=True)
class PlaneSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]  # per chunk (one head of one block)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


class TensorCodec(ABC):
    """Encodes K or V. Invariant: ``decode(encode(x))`` has ``x``'s shape. Per-token codecs take any
    ``(*, hd)`` rows and their chunk shapes are ``(block_size, *row shape)``; block codecs take
    ``(N, block_size, hd)`` chunks."""

    name: str = ""
    is_per_token: bool = True
    is_lossless: bool = False

    @abstractmethod
    def planes(self, block_size: int, head_dim: int) -> dict[str, PlaneSpec]: ...

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Planes: ...

    @abstractmethod
    def decode(self, planes: Planes, dtype: torch.dtype) -> torch.Tensor: ...

    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError when this codec cannot store heads of this size."""
        if num_kv_heads < 1 or head_dim < 1:
            raise ValueError(
                f"KV heads need num_kv_heads >= 1 and head_dim >= 1, got {num_kv_heads}, {head_dim}"
            )


# --- fp16 affine parameters ---------------------------------------------------------------------------------
def _round_fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """Nearest fp16 at or above (``up``) / at or below ``x``, back in float32."""
    h = x.to(torch.float16)
    wrong = h.float() < x if up else h.float() > x
    h = torch.where(wrong, torch.nextafter(h, torch.full_like(h, float("inf" if up else "-inf"))), h)
    return h.float()


def affine_params(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-exact (scale, zero) with ``zero <= lo`` and ``zero + levels * scale >= hi``."""
    zero = _round_fp16(lo.float(), up=False) + 0.0  # -0 -> +0: which zero a min picks is the kernel's choice
    scale = _round_fp16(((hi.float() - zero) / levels).clamp_min(_FP16_TINY), up=True)
    return scale, zero


def coded_affine_params(
    lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, Planes]:
    """Affine (scale, zero) per group for chunks ``lo``, ``hi`` (N, *groups), stored as uint8 codes: per chunk,
    fp16 ``meta`` = (zmin, dz, ds), zero = zmin + zero_code * dz <= lo and scale = scale_code * ds with
    zero + levels * scale >= hi, so every value still maps inside the integer range. Returns the float32
    (scale, zero) the codes decode to (what to quantize with) and the planes ``scale``, ``zero``, ``meta``."""
    n, view = lo.shape[0], (lo.shape[0],) + (1,) * (lo.dim() - 1)
    lo, hi = lo.float(), hi.float()
    zmin = _round_fp16(lo.reshape(n, -1).amin(1), up=False) + 0.0  # -0 -> +0, as affine_params
    dz = _round_fp16(((lo.reshape(n, -1).amax(1) - zmin) / 255).clamp_min(_FP16_TINY), up=True)
    zmin_, dz_ = zmin.view(view), dz.view(view)
    zero_code = ((lo - zmin_) / dz_).floor_().clamp_(0, 255)
    # float32 rounding of zmin + code * dz may land a hair above lo: one code lower is below it
    zero_code = torch.where(zmin_ + zero_code * dz_ > lo, (zero_code - 1).clamp_min(0), zero_code)
    zero = zmin_ + zero_code * dz_
    need = (hi - zero) / levels
    # 254 steps leave room to round a code up once more where float32 rounding falls short of hi
    ds = _round_fp16((need.reshape(n, -1).amax(1) / 254).clamp_min(_FP16_TINY), up=True)
    ds_ = ds.view(view)
    scale_code = (need / ds_).ceil_().clamp_(1, 254)
    scale_code = torch.where(zero + levels * (scale_code * ds_) < hi, scale_code + 1, scale_code)
    planes = {
        "scale": scale_code.to(torch.uint8),
        "zero": zero_code.to(torch.uint8),
        "meta": torch.stack((zmin, dz, ds), -1).half(),
    }
    return scale_code * ds_, zero, planes


def decode_affine_params(planes: Planes, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) from ``coded_affine_params``'s planes, computed in float32 (as encoded), then ``dtype``."""
    codes = planes["zero"]
    meta = planes["meta"].float().view(codes.shape[0], *(1,) * (codes.dim() - 1), 3)
    zero = meta[..., 0] + codes.float() * meta[..., 1]
    scale = planes["scale"].float() * meta[..., 2]
    return scale.to(dtype), zero.to(dtype)


def _quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    return ((x.float() - zero) / scale).round_().clamp_(0, levels).to(torch.uint8)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    # q: (..., hd) values 0..15 -> (..., hd/2), even channels in the low nibble
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)  # (..., hd/2) -> (..., hd)


# --- tensor codecs ------------------------------------------------------------------------------------------
class Identity(TensorCodec):
    """Stores the values as they are, in ``dtype`` (fp32 / bf16 / fp16)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.is_lossless = dtype == torch.float32
        self.name = str(dtype).removeprefix("torch.")

    def planes(self, block_size: int, head_dim: int) -> dict[str, PlaneSpec]:
        return {"x": PlaneSpec(self.dtype, (block_size, head_dim))}

    def encode(self, x: torch.Tensor) -> Planes:
        return {"x": x.to(self.dtype)}

    def decode(self, planes: Planes, dtype: torch.dtype) -> torch.Tensor:
        return planes["x"].to(dtype)


class Int8PerToken(TensorCodec):
    """Asymmetric uint8 per (token, head): x ~ q * scale + zero, fp16 scale and zero."""

    name = "int8"

    def planes(self, block_size: int, head_dim: int) -> dict[str, PlaneSpec]:
        return {
            "q": PlaneSpec(torch.uint8, (block_size, head_dim)),
            "scale": PlaneSpec(torch.float16, (block_size,)),
            "zero": PlaneSpec(torch.float16, (block_size,)),
        }

    def encode(self, x: torch.Tensor) -> Planes:
        lo, hi = torch.aminmax(x.float(), dim=-1)
        scale, zero = affine_params(lo, hi, 255)
        q = _quantize(x, scale.unsqueeze(-1), zero.unsqueeze(-1), 255)
        return {"q": q, "scale": scale.half(), "zero": zero.half()}

    def decode(self, planes: Planes, dtype: torch.dtype) -> torch.Tensor:
        # NOTE: mul_/add_ rather than addcmul: broadcast addcmul has no fast CPU kernel.
        scale, zero = planes["scale"].to(dtype).unsqueeze(-1), planes["zero"].to(dtype).unsqueeze(-1)
        return planes["q"].to(dtype).mul_(scale).add_(zero)


class Fp8PerToken(TensorCodec):
    """float8 e4m3 values with an fp16 scale per (token, head) mapping the row's max |x| to 448."""

    name = "fp8"
    FP8_MAX = 448.0

    def planes(self, block_size: int, head_dim: int) -> dict[str, PlaneSpec]:
        return {
            "q": PlaneSpec(torch.float8_e4m3fn, (block_size, head_dim)),
            "scale": PlaneSpec(torch.float16, (block_size,)),
        }

    def encode(self, x: torch.Tensor) -> Planes:
        x = x.float()
        scale = _round_fp16((x.abs().amax(dim=-1) / self.FP8_MAX).clamp_min(_FP16_TINY), up=True)
        q = (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        return {"q": q, "scale": scale.half()}

    def decode(self, planes: Planes, dtype: torch.dtype) -> torch.Tensor:
        return planes["q"].to(dtype).mul_(planes["scale"].to(dtype).unsqueeze(-1))


class Int4PerChannel(TensorCodec):
    """KIVI keys: 4-bit asymmetric per (block, head, channel) over the block's tokens, packed two channels
    per byte; the channels' scales and zeros as uint8 codes (``coded_affine_params``). A block codec: the
    block must be full before it can be encoded."""

    name = "int4_per_channel"
    is_per_token = False

    def planes(self, block_size: int, head_dim: int) -> dict[str, PlaneSpec]:
        return {
            "q": PlaneSpec(torch.uint8, (block_size, head_dim // 2)),
            "scale": PlaneSpec(torch.uint8, (head_dim,)),
            "zero": PlaneSpec(torch.uint8, (head_dim,)),
            "meta": PlaneSpec(torch.float16, (3,)),
        }

    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        if head_dim % 2:
            raise ValueError(f"int4 KV needs an even head_dim, got {head_dim}")

    def encode(self, x: torch.Tensor) -> Planes:
        # x: (N, bs, hd) chunks; statistics over the block's tokens (dim 1)
        lo, hi = torch.aminmax(x.float(), dim=1)  # (N, hd)
        scale, zero, params = coded_affine_params(lo, hi, 15)
        q = _quantize(x, scale.unsqueeze(1), zero.unsqueeze(1), 15)
        return {"q": _pack4(q), **params}

    def decode(self, planes: Planes, dtype: torch.dtype) -> torch.Tensor:
        q = _unpack4(planes["q"]).to(dtype)  # (N, bs, hd)
        scale, zero = decode_affine_params(planes, dtype)
        return q.mul_(scale.unsqueeze(1)).add_(zero.unsqueeze(1))


class Int4PerTokenGroup(TensorCodec):
    """KIVI values: 4-bit asymmetric per (token, head, group of ``group_size`` channels); the groups' scales
    and zeros as uint8 codes over the block (``coded_affine_params``), so a block codec, like the keys."""

    name = "int4_per_token"
    is_per_token = False

    def __init__(self, group_size: int = 32) -> None:
        self.group_size = group_size

    def _group(self, head_dim: int) -> int:
        return min(self.group_size, head_dim)

    def planes(self, block_size: int, head_dim: int) -> dict[str, PlaneSpec]:
        num_groups = head_dim // self._group(head_dim)
        return {
            "q": PlaneSpec(torch.uint8, (block_size, head_dim // 2)),
            "scale": PlaneSpec(torch.uint8, (block_size, num_groups)),
            "zero": PlaneSpec(torch.uint8, (block_size, num_groups)),
            "meta": PlaneSpec(torch.float16, (3,)),
        }

    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        if head_dim % 2 or head_dim % self._group(head_dim):
            raise ValueError(
                f"int4 KV values need head_dim ({head_dim}) even and a multiple of the group size "
                f"({self.group_size})"
            )

    def encode(self, x: torch.Tensor) -> Planes:
        # x: (N, bs, hd) chunks
        hd = x.shape[-1]
        g = self._group(hd)
        xg = x.float().unflatten(-1, (hd // g, g))  # (N, bs, ng, g)
        lo, hi = torch.aminmax(xg, dim=-1)
        scale, zero, params = coded_affine_params(lo, hi, 15)
        q = _quantize(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), 15).flatten(-2)
        return {"q": _pack4(q), **params}

    def decode(self, planes: Planes, dtype: torch.dtype) -> torch.Tensor:
        q = _unpack4(planes["q"]).to(dtype)
        ng = planes["scale"].shape[-1]
        qg = q.unflatten(-1, (ng, q.shape[-1] // ng))
        scale, zero = decode_affine_params(planes, dtype)
        qg.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))
        return qg.flatten(-2)


# --- KV codecs and the registry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCodec:
    """How one layer's K and V are stored. ``is_staged``: a request's last, not yet full block is kept in
    full precision (the staging store) and encoded when it fills. ``default_block_size``: the block (tokens)
    a ``KVCompressor`` with this codec uses unless told otherwise; for per-channel keys the block is the key
    group, so int4 takes KIVI's 32."""

    name: str
    key: TensorCodec
    value: TensorCodec
    is_staged: bool = False
    default_block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def is_lossless(self) -> bool:
        return self.key.is_lossless and self.value.is_lossless

    def check_shape(self, num_kv_heads: int, head_dim: int) -> None:
        self.key.check_shape(num_kv_heads, head_dim)
        self.value.check_shape(num_kv_heads, head_dim)

    def block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one block of K and V in one layer, scales and zero points included."""
        specs = [
            *self.key.planes(block_size, head_dim).values(),
            *self.value.planes(block_size, head_dim).values(),
        ]
        return num_kv_heads * sum(s.nbytes for s in specs)

    def bytes_per_token(self, block_size: int, num_kv_heads: int, head_dim: int) -> float:
        """K + V bytes per token per layer (block-level scales spread over the block's tokens)."""
        return self.block_bytes(block_size, num_kv_heads, head_dim) / block_size


CODECS: dict[str, Callable[[], KVCodec]] = {}


def register_codec(name: str) -> Callable[[Callable[[], KVCodec]], Callable[[], KVCodec]]:
    def wrap(factory: Callable[[], KVCodec]) -> Callable[[], KVCodec]:
        CODECS[name] = factory
        return factory

    return wrap


def identity_codec(dtype: torch.dtype) -> KVCodec:
    codec = Identity(dtype)
    return KVCodec(codec.name, codec, codec)


# the codecs that store K/V as the model computes them, by the model's dtype
IDENTITY_CODECS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
for _dtype, _name in IDENTITY_CODECS.items():
    register_codec(_name)(functools.partial(identity_codec, _dtype))


@register_codec("int8")
def _int8() -> KVCodec:
    codec = Int8PerToken()
    return KVCodec("int8", codec, codec)


@register_codec("fp8")
def _fp8() -> KVCodec:
    codec = Fp8PerToken()
    return KVCodec("fp8", codec, codec)


@register_codec("int4")
def _int4() -> KVCodec:
    # Keys per channel over 32-token blocks (KIVI's group): 217 B per token and layer on SmolLM2, 3.54x fewer
    # than bf16 (3.34x at 16-token blocks, where the per-block channel scales cost more).
    return KVCodec("int4", Int4PerChannel(), Int4PerTokenGroup(32), is_staged=True, default_block_size=32)


@register_codec("int4-g64")
def _int4_g64() -> KVCodec:
    # Values in groups of 64 channels: half the value scale bytes of "int4". With 64-token blocks (the key
    # group) this stores ~205 B per token and layer on SmolLM2 vs bf16's 768 (3.75x fewer).
    return KVCodec("int4-g64", Int4PerChannel(), Int4PerTokenGroup(64), is_staged=True, default_block_size=64)


def default_block_size(name: str) -> int:
    """The block size (tokens) codec ``name`` is used with unless one is given."""
    return make_codec(name).default_block_size


def describe_default_block_sizes() -> str:
    """Each codec's default block size for help and error texts, from the registry: "16; int4 32, ..."."""
    other = [f"{n} {b}" for n in CODECS if (b := default_block_size(n)) != DEFAULT_BLOCK_SIZE]
    return f"{DEFAULT_BLOCK_SIZE}" + (f"; {', '.join(other)}" if other else "")


def make_codec(name: str) -> KVCodec:
    if name not in CODECS:
        raise ValueError(f"unknown KV codec {name!r}; available: {', '.join(sorted(CODECS))}")
    return CODECS[name]()
