"""Quantized linears, one module per weight format, built from the math in ``quantizer``.

Each module's forward is a real kernel:
our CPU GEMVs at decode sizes (``kernels/gemv.cpp``), dequantize + oneDNN GEMM for prefill on CPUs
without fast bf16, else torch's (``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``,
``torch._scaled_mm``, ``F.linear``), plus dtype casts when its ``compute_dtype`` differs from the input's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcp2026.kernels import gpu as kernel_gpu
from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.plan import DENSE_FORMATS, LayerQuantSpec, high_row_count, linear_modules
from mcp2026.quant.quantizer import (
    DENSE_DTYPES,
    FP8_DTYPE,
    FP8_MAX,
    _high_spec,
    _low_spec,
    correction_bias,
    dequantize_groupwise_int4,
    dequantize_per_channel_int8,
    mse_clip_ratios,
    quantize_int4,
    quantize_per_channel_fp8,
    quantize_per_channel_int8,
    split_rows,
)


def _check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise ValueError(
            f"int4 group size {group_size} must divide in_features={in_features}; "
            f"usable sizes here: {[g for g in (32, 64, 128) if in_features % g == 0] or 'none'}"
        )
    if out_features % 16:
        raise ValueError(
            f"int4 kernel packs 16 output rows at a time; out_features={out_features} is not a multiple of 16"
        )


# Our int4/int8 GEMVs (kernels/gemv.cpp) take decode-sized batches on every CPU. On CPUs without fast
# bf16, torch's int kernels compute in bf16 (slower than fp32 on AVX2), so there the GEMVs (in 8-row tiles) also
# take batched decode and mixed steps up to a row limit per format, and larger inputs run dequantize + fp32
# GEMM. Measured once with a throwaway microbenchmark (2 threads, one layer's linears; no repo command): int8
# GEMV 14.7 vs dequantize + GEMM 27.4 ms at 128 rows, 35 vs 25 at 256 (limit 128); int4 GEMV after its
# vectorized scales 9.4 / 16.7 / 24.4 / 32.4 ms at 128 / 256 / 384 / 512 rows against 11.6 / 18.9 /
# 25.2 / 32.8 (fp32 weights 9.9 / 16.7 / 22.7 / 30.4). Limit 256: above it the gain is within noise, and the
# GEMV quantizes activations to int8 (~+0.3 points of ΔPPL, docs/benchmarks.md "Quality through the decode
# kernels"), so prefill chunks stay on float activations where the GEMV buys nothing.
GEMV_MAX_ROWS = 8
GEMV_BATCH_MAX_ROWS = 128  # int8 weights
INT4_GEMV_BATCH_MAX_ROWS = 256
DEQUANT_MIN_ROWS = GEMV_BATCH_MAX_ROWS + 1
INT4_DEQUANT_MIN_ROWS = INT4_GEMV_BATCH_MAX_ROWS + 1
# On AVX512-BF16 CPUs torch's int4 kernel computes in bf16, and a dequantize to bf16 (into a reused buffer) +
# one bf16 GEMM beats it from about 20 rows. Measured on an AMX Xeon (AVX-512 dequantize, 2 threads,
# throwaway script, the int4 serving config, whole prefill steps without prefix-cache hits, two passes): at
# 16 / 24 / 32 / 48 / 64 tokens 42-43 / 44-45 / 47-49 / 53-54 / 58-64 ms this way, 34-38 / 49-53 / 59-64 /
# 63-88 / 110-116 ms through torch's kernel; a 16-sequence decode step 85 against 69 ms; decode steps of 24 /
# 32 / 48 sequences (256-token prompts, 64-sequence config) 76-78 / 75-82 / 91-103 against 79-83 / 98-100 /
# 137-145 ms. A row's last bits can change where its step crosses this limit, as at the GEMV's. (On one layer's
# linears with weights in cache the crossover is ~12 rows; in a step the bf16 copy makes a round trip through
# memory.) On an AVX512-BF16 EPYC, older dequantize: 576 -> 3072 at 128 / 512 rows 1.8 / 5.7 ms against
# 3.7 / 14.3; the crossover there was not re-measured.
INT4_BF16_DEQUANT_MIN_ROWS = 20
# INT4_GEMM: with AVX-512 VNNI, our int4 GEMM (kernels/int4_gemm.cpp) takes every row count: the activations
# quantized to int8 per 32 values as the GEMV does, 16-column tiles of weights in L1. Every row's arithmetic is
# the same at any row count (batch-invariant), and prefill rounds activations as decode does (~+0.3 points of
# ΔPPL on int4 asym g32 against float activations, docs/benchmarks.md "Quality through the decode kernels").
# INT8_GEMM: likewise int8 layers (kernels/int8_gemm.cpp) at every row count whose shape fits its tiles (N in
# 16s, K in 32s), with the activations in two int8 planes per 32 values (x to within 1/512 of the block's int8
# step: one plane, as the int4 kernels use, took int8 weights from +0.16% to +0.35% ΔPPL on 20 windows, two
# give +0.13%).
# Per layer, `mcp2026 bench plugin examples/bench_plugins/quant_gemm.py:QuantGemm --param rows=1,32,512` (2-core
# Zen 4 EPYC; the paths alternate, so each call finds the caches as another path left them), ms for qkv / o /
# gate_up / down. int4: 32 rows 0.19 / 0.11 / 0.43 / 0.20 against the routing without the GEMM 0.63 / 0.33 /
# 1.59 / 0.64; 512 rows 1.5 / 0.92 / 3.7 / 2.1 against 3.5 / 2.2 / 9.4 / 4.9. int8: 32 rows 0.31 / 0.19 / 0.81 /
# 0.38 against dequantize + fp32 GEMM 2.3 / 0.63 / 3.4 / 1.4 (the routing without the GEMM takes torch's int8
# kernel on this AVX512-BF16 CPU: 16 / 9.4 / 49 / 21); 512 rows 2.9 / 1.9 / 8.2 / 3.7 against 5.0 / 2.9 / 19 /
# 6.1 (fp32 weights 4.5 / 2.5 / 17 / 5.6). At 1 row the GEMVs are as fast or faster there (gate_up int4 0.09 vs
# 0.20 ms, int8 0.13 vs 0.21), where a warm-cache loop had the GEMMs ahead (0.016 vs 0.041 ms); whole decode
# steps went faster with the GEMMs (bench latency: int8 80 -> 99 tok/s), but a step-level A/B of GEMV against
# GEMM at 1-8 rows has not been run.


# torch 2.13's AVX-512 `_weight_int8pack_mm` uses aligned 16-byte loads on every row of the activations and
# the weights: a row start off a 16-byte boundary is a segfault (or garbage), seen on an AVX512-BF16 EPYC with
# K = 8 and 168 (rows of 8 / 168 bytes) and with weights mmapped from an artifact at an 8-byte offset. So such
# layers (K not a multiple of 16) dequantize instead, and the operands are realigned where needed. Every
# linear of the default model has K = 576 or 1536.
INT8PACK_K_MULTIPLE = 16
INT8PACK_ALIGN = 64


def _aligned(t: Tensor) -> Tensor:
    return t if t.data_ptr() % INT8PACK_ALIGN == 0 else t.clone()


def gemv_rows(x2: Tensor, batch_max_rows: int = GEMV_BATCH_MAX_ROWS) -> bool:
    rows = x2.shape[0]
    return rows <= GEMV_MAX_ROWS or (rows <= batch_max_rows and _bf16_int_kernels_slow(x2))


def _bf16_int_kernels_slow(x: Tensor) -> bool:
    """fp32 activations on a CPU where bf16 GEMMs are slow (the int kernels' compute dtype): our GEMVs or
    dequantize + fp32 GEMM beat torch's int kernels there, for batched decode and prefill alike."""
    return x.dtype == torch.float32 and x.is_cpu and not _cpu_has_fast_bf16()


@functools.cache
def _cpu_has_fast_bf16() -> bool:
    from mcp2026.hardware import default_activation_dtype

    return default_activation_dtype("cpu") == torch.bfloat16


def gemv_layout(q: Tensor, scales_and_zeros: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """q (N, K) in 0..15 and torch's (K/g, N, 2) scales and zeros -> the GEMV kernel's 32-wide blocks: bytes
    (N, K/32, 16) holding elements i (low nibble) and i + 16 (high) of each block, and (N, K/32, 2) bf16
    scale and zero per block (the same bits, repeated when a group spans several blocks)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).contiguous()
    sz = scales_and_zeros.to(torch.bfloat16).transpose(0, 1)  # (N, K/g, 2)
    return packed, sz.repeat_interleave(group_size // 32, dim=1).contiguous()


def pack_int4(q: Tensor) -> Tensor:
    """q (N, K) values 0..15 -> the CPU kernel's packed layout, uint8 (N, K/2)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


@functools.cache
def int4pack_block_rows() -> int:
    """Rows per block of torch's packed int4 layout on this CPU: it depends on the kernel torch dispatches to
    (64 with AVX-512, 32 with AVX2), so it is read off one tiny pack, not assumed."""
    q = (torch.arange(64, dtype=torch.int32) // 16).repeat_interleave(2).view(64, 2)  # q[r, :] = r // 16
    first = int(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).reshape(-1)[0])
    rows = 32 * (first >> 4)  # byte 0 holds row 0 and row rows / 2
    if first & 0xF or rows not in (32, 64):
        raise RuntimeError(f"unknown int4 pack layout in this torch build (first byte {first:#x})")
    return rows


def unpack_int4(packed: Tensor, out_features: int, in_features: int, block_rows: int | None = None) -> Tensor:
    """Inverse of ``pack_int4`` on a CPU whose layout has ``block_rows`` (default: this one's). NOTE: the
    layout is torch's (checked by a round-trip test): blocks of B rows, byte (k, j) of a block holds row j in
    its low nibble and row j + B/2 in its high nibble; the rows past the last full block form one block whose
    byte (k, j) holds rows 2j / 2j + 1 in the low / high nibble."""
    n, k = out_features, in_features
    rows = block_rows or int4pack_block_rows()
    flat = packed.reshape(-1)
    full = n // rows * rows
    blocks = flat[: full * k // 2].view(n // rows, k, rows // 2)  # (nb, K, B/2)
    q = torch.cat([blocks & 0xF, blocks >> 4], dim=2).permute(0, 2, 1).reshape(full, k)
    if n > full:
        tail = flat[full * k // 2 :].view(k, (n - full) // 2)
        tail_q = torch.stack([tail & 0xF, tail >> 4], dim=2).reshape(k, n - full).t()
        q = torch.cat([q, tail_q])
    return q


# ---- modules -------------------------------------------------------------------------------------
class QuantLinear(nn.Module):
    """Base of the quantized linears: y = x @ dequantize().T + bias, computed in ``compute_dtype``.

    NOTE: the input is cast to ``compute_dtype`` and the output back only when they differ: two
    elementwise copies (~3 us at batch 1, ~6 us at batch 32 for K=576 on a 2-core AVX2 EPYC), paid
    because there the int kernels run ~10x faster with bf16 than with fp32 activations (backend.py).
    ``inv_act_scale`` (K,), when set, multiplies the input first: the weight was stored times s
    (activation-aware scaling), so the module divides by s. It could be folded into a preceding norm.
    """

    formats: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        in_features: int,
        out_features: int,
        spec: LayerQuantSpec,
        bias: bool,
        compute_dtype: torch.dtype,
    ):
        super().__init__()
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.compute_dtype = compute_dtype
        self.register_buffer("bias", torch.zeros(out_features, dtype=compute_dtype) if bias else None)
        # 1 / s per input channel, fp32, when the spec names an activation scale (set by from_linear)
        self.register_buffer("inv_act_scale", torch.ones(in_features) if spec.act_scale else None)

    @staticmethod
    def dtype_of(fmt: str) -> torch.dtype:
        return DENSE_DTYPES[fmt]

    @classmethod
    def kernel_on(cls, device: torch.device) -> str | None:
        """Name of the real kernel this module runs on ``device``, or None where there is none."""
        raise NotImplementedError

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        spec: LayerQuantSpec,
        compute_dtype: torch.dtype | None = None,
        act_scale: Tensor | None = None,
        *,
        row_scores: Tensor | None = None,
        input_mean: Tensor | None = None,
    ) -> QuantLinear:
        """Quantize ``linear`` (never modifying it: a tied weight stays as it is). ``row_scores`` rank a split
        spec's rows; ``input_mean`` (calibration's mean input) is what a spec with bias correction needs."""
        w = linear.weight.detach()
        module = cls(
            linear.in_features, linear.out_features, spec, _has_bias(linear, spec), compute_dtype or w.dtype
        )
        if (act_scale is None) != (spec.act_scale is None):
            raise ValueError(f"spec.act_scale={spec.act_scale!r} needs an act_scale tensor (and only then)")
        if (input_mean is None) != (spec.bias_correction is None):
            raise ValueError(
                f"spec.bias_correction={spec.bias_correction!r} needs an input_mean tensor (and only then)"
            )
        if row_scores is not None and not spec.high_rows:
            raise ValueError("row_scores rank the rows of a split spec (high_rows > 0) only")
        if act_scale is not None:
            act_scale = act_scale.detach().float().to(w.device)
            module.inv_act_scale = 1.0 / act_scale  # fp32: applied before the cast to compute_dtype
        scaled = w.float() if act_scale is None else w.float() * act_scale
        module._load(scaled, row_scores) if spec.high_rows else module._load(scaled)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        if input_mean is not None:
            correction = correction_bias(w, module.dequantize(), input_mean)
            bias = correction if bias is None else bias + correction
        if bias is not None:
            module.bias = bias.to(module.compute_dtype).clone()
        return module.to(w.device)

    def _load(self, w: Tensor) -> None:
        raise NotImplementedError

    def _quantized(self) -> Tensor:
        raise NotImplementedError

    # NOTE: Python-side checks instead of no-op tensor calls: each dispatch costs ~1 us at batch 1.
    def _input(self, x: Tensor) -> Tensor:
        """x (..., K) -> (M, K) contiguous in compute_dtype (the kernels take 2-D input only)."""
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if self.inv_act_scale is not None:
            x2 = x2 * self.inv_act_scale
        if x2.dtype != self.compute_dtype:
            x2 = x2.to(self.compute_dtype)
        return x2 if x2.is_contiguous() else x2.contiguous()

    def _scaled(self, x: Tensor) -> Tensor:
        """x divided by the activation-aware scale, where the layer has one (fp32 paths of our kernels)."""
        return x if self.inv_act_scale is None else x * self.inv_act_scale

    def _output(self, y: Tensor, x: Tensor) -> Tensor:
        if self.bias is not None:
            y = y + self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _drop_kernel_copies(self) -> None:
        """Forget what was derived from the weights for the kernels (GEMV layouts, the fused-layer handle)."""
        for key in ("_gemv", "_gemm", "_gemv_scales", "_fused", "_cuda"):
            self.__dict__.pop(key, None)

    def _clip(self, w: Tensor) -> float | Tensor:
        return mse_clip_ratios(w, self.spec) if self.spec.clip_ratio == "mse" else self.spec.clip_ratio

    def dequantize(self) -> Tensor:
        """The fp32 (N, K) weight this module computes with: forward(x) ~= x @ dequantize().T + bias."""
        w = self._quantized()
        return w if self.inv_act_scale is None else w * self.inv_act_scale

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight (bf16 scales/zeros), as in ``LayerQuantSpec.bits_per_weight``."""
        return self.spec.bits_per_weight(self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes this module holds now (scales are fp32 when the kernel runs in fp32)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.spec.format}, g={self.spec.group_size}, compute={self.compute_dtype}"


class DenseLinear(QuantLinear):
    """fp32 / bf16 / fp16 weights through ``ops.dense_linear`` (our GEMV at decode sizes on the CPU, where
    bf16 weights meet fp32 activations in fp32; oneDNN or ``F.linear`` beyond); ``compute_dtype`` is the
    weight's dtype, the one activations are cast to where no kernel computes in fp32."""

    formats = DENSE_FORMATS

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        dtype = self.dtype_of(spec.format)
        super().__init__(in_features, out_features, spec, bias, dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=dtype))

    @classmethod
    def kernel_on(cls, device):
        return "aten.linear"

    def _load(self, w):
        self.weight = w.to(self.compute_dtype)

    def _quantized(self):
        return self.weight.float()

    def forward(self, x: Tensor) -> Tensor:
        y = kernel_ops.dense_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(QuantLinear):
    """Per-output-channel symmetric int8 weights: our int8 GEMM on AVX-512 VNNI CPUs (INT8_GEMM), else our
    GEMV for decode-sized inputs and ``_weight_int8pack_mm`` (x @ q.T * scales) or dequantize + GEMM above."""

    formats = ("int8",)

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=compute_dtype))

    @classmethod
    def kernel_on(cls, device):
        if device.type == "cuda":
            return "triton int8 weight-only matmul" if kernel_gpu.load() is not None else None
        return "aten._weight_int8pack_mm" if device.type in ("cpu", "mps") else None

    def _load(self, w):
        self._drop_kernel_copies()
        self.weight, scales = quantize_per_channel_int8(w, self._clip(w))
        self.scales = scales.to(self.compute_dtype)

    def _quantized(self):
        return dequantize_per_channel_int8(self.weight, self.scales)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.is_cuda:
            gpu = kernel_gpu.kernels_for(x2)
            if gpu is None:
                raise RuntimeError(f"int8 weights on {x2.device} need our Triton kernel: pip install triton")
            return self._output(gpu.int8_matmul(self._input(x2).contiguous(), self.weight, self.scales), x)
        if self.gemm_shape_ok():
            kernels = kernel_ops.vnni_gemm_kernels(x2)
            if kernels is not None:  # AVX-512 VNNI: our int8 x int8 GEMM at every row count (see INT8_GEMM)
                return self._output(
                    kernels.int8_gemm(self._scaled(x2), self.gemm_weights(), self.gemv_scales()), x
                )
        if gemv_rows(x2):
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # decode: our int8-weight GEMV (float activations), no casts
                x2 = self._scaled(x2)
                return self._output(kernels.int8_gemv(x2, self.weight, self.gemv_scales()), x)
        if x2.shape[0] >= DEQUANT_MIN_ROWS and _bf16_int_kernels_slow(x2):
            w = self.weight * self.scales.float().unsqueeze(1)  # one pass: int8 * fp32 -> fp32
            xs = self._scaled(x2)
            return self._output(kernel_ops.prefill_linear(xs, w), x)
        if self.in_features % INT8PACK_K_MULTIPLE:
            y = F.linear(self._input(x), self._quantized().to(self.compute_dtype))
            return self._output(y, x)
        if self.weight.data_ptr() % INT8PACK_ALIGN:  # mmapped from a file: one aligned copy
            self.weight = self.weight.clone()
        y = torch.ops.aten._weight_int8pack_mm(_aligned(self._input(x)), self.weight, self.scales)
        return self._output(y, x)

    def gemm_shape_ok(self) -> bool:
        """Whether the int8 GEMM takes this layer: 16-column tiles, 32-value activation blocks."""
        return self.out_features % 16 == 0 and self.in_features % 32 == 0

    def gemm_weights(self) -> Tensor:
        """The weights in the int8 GEMM's layout (16-column tiles, +128), built on first use."""
        gemm = self.__dict__.get("_gemm")
        if gemm is None:
            gemm = self.__dict__["_gemm"] = kernel_ops.cpu.load().int8_gemm_pack(self.weight)
        return gemm

    def gemv_scales(self) -> Tensor:
        """The scales as the GEMV and GEMM take them (fp32, contiguous), built on first use."""
        scales = self.__dict__.get("_gemv_scales")
        if scales is None:
            scales = self.__dict__["_gemv_scales"] = self.scales.float().contiguous()
        return scales

    def _load_from_state_dict(self, *args, **kwargs):  # new scales: refresh the GEMV copy on next use
        self._drop_kernel_copies()
        super()._load_from_state_dict(*args, **kwargs)


class Int4Linear(QuantLinear):
    """Group-wise int4 (g32/64/128, symmetric or with zero points), packed for the CPU kernel."""

    formats = ("int4",)

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        _check_int4_shape(out_features, in_features, spec.group_size)
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        num_groups = in_features // spec.group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        # (K/g, N, 2): [..., 0] scale, [..., 1] zero, the kernel's layout
        self.register_buffer(
            "scales_and_zeros", torch.empty(num_groups, out_features, 2, dtype=compute_dtype)
        )

    @classmethod
    def kernel_on(cls, device):
        if device.type == "cuda":  # torch's tinygemm kernel: Ampere and newer
            return "aten._weight_int4pack_mm" if torch.cuda.get_device_capability(device) >= (8, 0) else None
        return "aten._weight_int4pack_mm_for_cpu" if device.type == "cpu" else None

    def _load(self, w):
        self._drop_kernel_copies()
        q, scales, zeros = quantize_int4(w, self.spec)
        self.weight = pack_int4(q.cpu()).to(w.device)
        self.scales_and_zeros = (
            torch.stack([scales.t(), zeros.t()], dim=-1).to(self.compute_dtype).contiguous()
        )

    def _quantized(self):
        q = unpack_int4(self.weight, self.out_features, self.in_features)
        scales, zeros = self.scales_and_zeros.float().unbind(-1)  # (K/g, N) each
        return dequantize_groupwise_int4(q, scales.t(), zeros.t(), self.spec.group_size)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.is_cuda:  # bf16 activations and scales: the only dtype torch's CUDA kernel takes
            y = torch.ops.aten._weight_int4pack_mm(
                self._input(x2).contiguous(), self.cuda_weights(), self.spec.group_size, self.scales_and_zeros
            )
            return self._output(y, x)
        kernels = kernel_ops.vnni_gemm_kernels(x2)
        if kernels is not None:  # AVX-512 VNNI: our int4 x int8 GEMM at every row count (see INT4_GEMM)
            return self._output(kernels.int4_gemm(self._scaled(x2), *self.gemm_weights()), x)
        if gemv_rows(x2, INT4_GEMV_BATCH_MAX_ROWS):
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # decode: our int4 x int8 GEMV, no casts
                x2 = self._scaled(x2)
                return self._output(kernels.int4_gemv(x2, *self.gemv_weights()), x)
        if x2.shape[0] >= INT4_DEQUANT_MIN_ROWS and _bf16_int_kernels_slow(x2):
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # fp32 GEMM
                w = kernels.int4_dequant(*self.gemv_weights(), out=self._dequant_buffer(torch.float32))
                return self._output(kernel_ops.prefill_linear(self._scaled(x2), w), x)
        if x2.shape[0] >= INT4_BF16_DEQUANT_MIN_ROWS and x2.is_cpu and _cpu_has_fast_bf16():
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # a GEMM in the compute dtype, as torch's int4 kernel computes
                bf16 = self.compute_dtype == torch.bfloat16
                w = kernels.int4_dequant(
                    *self.gemv_weights(),
                    out_bf16=bf16,
                    out=self._dequant_buffer(torch.bfloat16 if bf16 else torch.float32),
                )
                xs = self._input(x)  # an fp16 compute dtype runs the GEMM in fp32 (w is fp32 then)
                return self._output(F.linear(xs, w) if bf16 else kernel_ops.prefill_linear(xs.float(), w), x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            self._input(x), self.weight, self.spec.group_size, self.scales_and_zeros
        )
        return self._output(y, x)

    def cuda_weights(self) -> Tensor:
        """The weights in the layout of torch's CUDA int4 kernel (two values per byte, even k in the high
        nibble, then tiled by ``_convert_weight_to_int4pack``), built on first use from the CPU layout."""
        packed = self.__dict__.get("_cuda")
        if packed is None:
            q = unpack_int4(self.weight.cpu(), self.out_features, self.in_features).to(torch.uint8)
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(self.weight.device)
            inner_k_tiles = 8 if self.in_features % 1024 == 0 else 4 if self.in_features % 512 == 0 else 2
            packed = self.__dict__["_cuda"] = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
        return packed

    def _dequant_buffer(self, dtype: torch.dtype) -> Tensor:
        return kernel_ops.scratch((self.out_features, self.in_features), dtype)

    def gemv_weights(self) -> tuple[Tensor, Tensor]:
        """The weights in the GEMV kernel's layout, built on the first decode-sized call."""
        gemv = self.__dict__.get("_gemv")
        if gemv is None:
            q = unpack_int4(self.weight, self.out_features, self.in_features)
            gemv = self.__dict__["_gemv"] = gemv_layout(q, self.scales_and_zeros, self.spec.group_size)
        return gemv

    def gemm_weights(self) -> tuple[Tensor, Tensor]:
        """The weights in the int4 GEMM's layout (16-column tiles, fp32 scales and offsets per 32-block),
        built on first use from the GEMV layout, which is not kept (the GEMM replaces the GEMV here)."""
        gemm = self.__dict__.get("_gemm")
        if gemm is None:
            had_gemv = "_gemv" in self.__dict__
            packed = kernel_ops.cpu.load().int4_gemm_pack(*self.gemv_weights())
            gemm = self.__dict__["_gemm"] = (packed[0], packed[1])
            if not had_gemv:
                del self.__dict__["_gemv"]
        return gemm

    def _load_from_state_dict(self, *args, **kwargs):  # new weights: rebuild the GEMV layout on next use
        self._drop_kernel_copies()
        super()._load_from_state_dict(*args, **kwargs)


class Fp8Linear(QuantLinear):
    """e4m3 weights per output channel; activations quantized per row at run time (~1 ULP of e4m3,
    a few % per element), then ``torch._scaled_mm``. Only CUDA sm89+ has fp8 arithmetic; elsewhere
    the op runs but is not a real fp8 kernel (useful for measuring error, not for speed)."""

    formats = ("fp8",)

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("weight_scale", torch.empty(1, out_features, dtype=torch.float32))

    @classmethod
    def kernel_on(cls, device):
        is_sm89 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
        return "torch._scaled_mm" if is_sm89 else None

    def _load(self, w):
        self.weight, scales = quantize_per_channel_fp8(w, self._clip(w))
        self.weight_scale = scales[None, :]

    def _quantized(self):
        return self.weight.float() * self.weight_scale.t()

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._input(x)
        x_scale = (x2.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)  # (M, 1)
        x8 = (x2 / x_scale).to(FP8_DTYPE)
        y = torch._scaled_mm(
            x8, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=self.compute_dtype
        )
        return self._output(y, x)


class SplitRowsLinear(QuantLinear):
    """int4 weights with a chosen share of output rows in int8 (``LayerQuantSpec.high_rows``): two real
    kernels (``Int8Linear`` for the chosen rows, ``Int4Linear`` for the rest) and one gather putting the
    outputs back in row order. For a vocabulary projection: int4 noise on the ~49k logits of SmolLM2 costs
    +4.8% perplexity, and most of it sits on the few thousand tokens that carry the probability mass."""

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        k = high_row_count(out_features, spec.high_rows)
        if k == 0:
            raise ValueError(
                f"high_rows={spec.high_rows} of {out_features} rows rounds to no int8 rows (they come in 16s); "
                "raise high_rows or use plain int4"
            )
        self.high = Int8Linear(in_features, k, _high_spec(spec), False, compute_dtype)
        self.low = Int4Linear(in_features, out_features - k, _low_spec(spec), False, compute_dtype)
        self.register_buffer("high_index", torch.empty(k, dtype=torch.int32))  # sorted rows kept in int8

    @classmethod
    def kernel_on(cls, device):
        high, low = Int8Linear.kernel_on(device), Int4Linear.kernel_on(device)
        return f"{high} + {low}" if high and low else None

    def _load(self, w, row_scores=None):
        self._drop_kernel_copies()
        high = split_rows(w, self.spec, row_scores)
        low = self._low_rows(high)
        self.high._load(w[high])
        self.low._load(w[low])
        self.high_index = high.to(torch.int32)

    def _low_rows(self, high: Tensor) -> Tensor:
        keep = torch.ones(self.out_features, dtype=torch.bool, device=high.device)
        keep[high.long()] = False
        return keep.nonzero().squeeze(1)

    def order(self) -> Tensor:
        """Where each output row sits in [high outputs, low outputs] (the gather index), built once."""
        order = self.__dict__.get("_order")
        if order is None or order.device != self.high_index.device:  # new weights, or moved by .to()
            high = self.high_index.long()
            rows = torch.cat([high, self._low_rows(high)])
            order = torch.empty_like(rows)
            order[rows] = torch.arange(len(rows), device=rows.device)
            order = self.__dict__["_order"] = order
        return order

    def _drop_kernel_copies(self) -> None:
        super()._drop_kernel_copies()
        self.__dict__.pop("_order", None)

    def _quantized(self):
        w = torch.empty(self.out_features, self.in_features, device=self.high_index.device)
        high = self.high_index.long()
        w[high] = self.high.dequantize()
        w[self._low_rows(high)] = self.low.dequantize()
        return w

    def forward(self, x: Tensor) -> Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y = torch.cat([self.high(x2), self.low(x2)], dim=-1).index_select(-1, self.order())
        return self._output(y, x)

    @property
    def bits_per_weight(self) -> float:
        return self.spec.bits_per_weight(self.in_features, self.out_features)

    def _load_from_state_dict(self, *args, **kwargs):  # new row choice: rebuild the gather index
        self._drop_kernel_copies()
        super()._load_from_state_dict(*args, **kwargs)


LINEAR_FORMATS: dict[str, type[QuantLinear]] = {
    fmt: cls for cls in (DenseLinear, Int8Linear, Int4Linear, Fp8Linear) for fmt in cls.formats
}


def linear_class(spec: LayerQuantSpec) -> type[QuantLinear]:
    """The module that stores ``spec``: its format's, or ``SplitRowsLinear`` for a split int4 spec."""
    return SplitRowsLinear if spec.high_rows else LINEAR_FORMATS[spec.format]


def _has_bias(linear: nn.Linear, spec: LayerQuantSpec) -> bool:
    return linear.bias is not None or spec.bias_correction is not None


def empty_module(linear: nn.Linear, spec: LayerQuantSpec, compute_dtype: torch.dtype) -> QuantLinear:
    """An unfilled module shaped for ``spec`` (an artifact's state dict fills it)."""
    return linear_class(spec)(
        linear.in_features, linear.out_features, spec, _has_bias(linear, spec), compute_dtype
    )


def build_linear(
    name: str,
    linear: nn.Linear,
    spec: LayerQuantSpec,
    compute_dtype: torch.dtype | None = None,
    tensors: Mapping[str, Tensor] | None = None,
) -> QuantLinear:
    """Quantize one linear as ``spec`` says, taking the calibration tensors its spec names from ``tensors``
    (AWQ scales, row scores, mean inputs); a missing one is an error that names it."""
    found = {}
    for field, key in (("act_scale", spec.act_scale), ("row_scores", spec.row_scores),
                       ("input_mean", spec.bias_correction)):  # fmt: skip
        if key is not None:
            if tensors is None or key not in tensors:
                raise KeyError(
                    f"{name}: the plan names tensor {key!r} ({field}), not among the tensors passed"
                )
            found[field] = tensors[key]
    try:
        return linear_class(spec).from_linear(
            linear, spec, compute_dtype, found.pop("act_scale", None), **found
        )
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error


def quantize_(
    model: nn.Module,
    plan,
    tensors: Mapping[str, Tensor] | None = None,
    compute_dtypes: Mapping[str, torch.dtype] | Callable[[str], torch.dtype | None] | None = None,
) -> nn.Module:
    """Replace the model's nn.Linear submodules in place as ``plan.spec_for(name)`` says.

    Layers with no spec, or a dense spec of the dtype they already have, stay untouched.
    ``tensors``: name -> calibration tensor, for specs that name one (``act_scale``, ``row_scores``,
    ``bias_correction``; the DQG's result carries them).
    ``compute_dtypes``: format -> dtype the kernel runs in (pass ``backend.probe().compute_dtypes`` for
    the measured fastest); default: the layer's own weight dtype.
    """
    lookup = compute_dtypes.get if isinstance(compute_dtypes, Mapping) else compute_dtypes
    for name, linear in list(linear_modules(model)):
        spec = plan.spec_for(name)
        if not isinstance(linear, nn.Linear) or spec is None:
            continue
        if spec.format in DENSE_FORMATS and QuantLinear.dtype_of(spec.format) == linear.weight.dtype:
            continue
        module = build_linear(name, linear, spec, lookup and lookup(spec.format), tensors)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)
    return model
