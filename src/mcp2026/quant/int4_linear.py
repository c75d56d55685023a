"""Group-wise int4 weights as a ``QuantLinear``, in torch's packed layout (``int4_packing``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant import cpu_routing as routing
from mcp2026.quant.int4_packing import gemv_layout, pack_int4, unpack_int4
from mcp2026.quant.plan import SCALE_BITS
from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import (
    SCALE_DTYPE,
    decode_grids,
    dequantize_groupwise_int4,
    grid_codes,
    quantize_int4,
)


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise ValueError(
            f"int4 group size {group_size} must divide in_features={in_features}; "
            f"usable sizes here: {[g for g in (32, 64, 128) if in_features % g == 0] or 'none'}"
        )
    if out_features % 16:
        raise ValueError(
            f"int4 kernel packs 16 output rows at a time; out_features={out_features} is not a multiple of 16"
        )


class Int4Linear(QuantLinear):
    """Group-wise int4 (g32/64/128, symmetric or with zero points; grids in fp16 or 8-bit codes), packed for the
    CPU kernel."""

    formats = ("int4",)

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        check_int4_shape(out_features, in_features, spec.group_size)
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        num_groups = in_features // spec.group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        if spec.scale_bits == SCALE_BITS:
            # (K/g, N, 2): [..., 0] scale, [..., 1] zero, torch's int4 layout; fp16 whatever the compute dtype
            # (the quantizer rounds them to fp16: quantizer.SCALE_DTYPE), widened to fp32 by our kernels
            self.register_buffer(
                "scales_and_zeros", torch.empty(num_groups, out_features, 2, dtype=SCALE_DTYPE)
            )
        else:  # 8-bit grids (quantizer.grid_codes): (K/g, N) codes and each row's two step exponents
            self.register_buffer("scale_codes", torch.empty(num_groups, out_features, dtype=torch.uint8))
            self.register_buffer("zero_codes", torch.empty(num_groups, out_features, dtype=torch.int8))
            self.register_buffer("grid_exponents", torch.empty(out_features, 2, dtype=torch.int8))

    @classmethod
    def kernel_on(cls, device):
        if device.type == "cuda":  # torch's tinygemm kernel: Ampere and newer
            return "aten._weight_int4pack_mm" if torch.cuda.get_device_capability(device) >= (8, 0) else None
        return "aten._weight_int4pack_mm_for_cpu" if device.type == "cpu" else None

    @classmethod
    def from_levels(
        cls, linear: nn.Linear, spec, q: Tensor, scales: Tensor, zeros: Tensor, compute_dtype=None
    ) -> Int4Linear:
        """A module holding levels chosen elsewhere (GPTQ's, ``quant.gptq``): ``q`` (N, K) in 0..15, ``scales``
        and ``zeros`` (N, K/g), ``w = (q - 8) * scale + zero``; ``linear`` gives the shape and the bias."""
        w = linear.weight.detach()
        module = cls(
            linear.in_features, linear.out_features, spec, linear.bias is not None, compute_dtype or w.dtype
        )
        if q.shape != w.shape or scales.shape != (w.shape[0], w.shape[1] // spec.group_size):
            raise ValueError(
                f"levels {tuple(q.shape)} / grids {tuple(scales.shape)} do not fit a {tuple(w.shape)} int4 "
                f"g{spec.group_size} weight"
            )
        module._store(q, scales, zeros)
        if linear.bias is not None:
            module.bias = linear.bias.detach().to(module.compute_dtype).clone()
        return module.to(w.device)

    def _load(self, w):
        if self.spec.method != "rtn":
            raise ValueError(
                f"{self.spec.method} levels come with the layer's calibration: build with from_levels"
            )
        self._store(*quantize_int4(w, self.spec))

    def _store(self, q: Tensor, scales: Tensor, zeros: Tensor) -> None:
        """Levels (N, K) and grids (N, K/g); with 8-bit scales the grids must be coded ones (``quantize_int4``)."""
        self._drop_kernel_copies()
        self.weight = pack_int4(q.to(torch.uint8).cpu()).to(q.device)
        if self.spec.scale_bits == SCALE_BITS:
            self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(SCALE_DTYPE).contiguous()
            return
        scale_codes, zero_codes, exponents = grid_codes(scales.cpu(), zeros.cpu())
        self.scale_codes = scale_codes.t().contiguous().to(q.device)
        self.zero_codes = zero_codes.t().contiguous().to(q.device)
        self.grid_exponents = exponents.to(q.device)

    def grids(self) -> Tensor:
        """Scales and zeros (K/g, N, 2) in fp16, torch's int4 layout: stored so, or decoded from 8-bit codes on
        first use (exact: every code decodes to an fp16 value) and kept until the weights change."""
        if self.spec.scale_bits == SCALE_BITS:
            return self.scales_and_zeros
        decoded = self.__dict__.get("_grids")
        if decoded is None or decoded.device != self.scale_codes.device:  # new codes, or moved by .to()
            scales, zeros = decode_grids(self.scale_codes.t(), self.zero_codes.t(), self.grid_exponents)
            decoded = torch.stack([scales.t(), zeros.t()], dim=-1).to(SCALE_DTYPE).contiguous()
            self.__dict__["_grids"] = decoded
        return decoded

    def _drop_kernel_copies(self) -> None:
        super()._drop_kernel_copies()
        self.__dict__.pop("_grids", None)

    def _quantized(self):
        q = unpack_int4(self.weight, self.out_features, self.in_features)
        scales, zeros = self.grids().float().unbind(-1)  # (K/g, N) each
        return dequantize_groupwise_int4(q, scales.t(), zeros.t(), self.spec.group_size)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.is_cuda:  # bf16 activations and scales: the only dtype torch's CUDA kernel takes
            y = torch.ops.aten._weight_int4pack_mm(
                self._input(x2).contiguous(),
                self.cuda_weights(),
                self.spec.group_size,
                self.torch_scales(torch.bfloat16),
            )
            return self._output(y, x)
        kernels = kernel_ops.vnni_gemm_kernels(x2)
        if (
            kernels is not None
        ):  # AVX-512 VNNI: our int4 x int8 GEMM at every row count (docs/quantization.md)
            y = kernels.int4_gemm(self._scaled(x2), *self.gemm_weights(), self.bias)
            return self._output(y, x, bias_added=True)
        if routing.gemv_rows(x2, routing.INT4_GEMV_BATCH_MAX_ROWS):
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # decode: our int4 x int8 GEMV, no casts
                x2 = self._scaled(x2)
                return self._output(kernels.int4_gemv(x2, *self.gemv_weights()), x)
        if x2.shape[0] >= routing.INT4_DEQUANT_MIN_ROWS and routing.bf16_int_kernels_slow(x2):
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # fp32 GEMM
                w = kernels.int4_dequant(*self.gemv_weights(), out=self._dequant_buffer(torch.float32))
                return self._output(kernel_ops.prefill_linear(self._scaled(x2), w), x)
        if x2.shape[0] >= routing.INT4_BF16_DEQUANT_MIN_ROWS and x2.is_cpu and routing.cpu_has_fast_bf16():
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
        xs = self._input(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xs, self.weight, self.spec.group_size, self.torch_scales(xs.dtype)
        )
        return self._output(y, x)

    def torch_scales(self, dtype: torch.dtype) -> Tensor:
        """The scales and zeros in ``dtype``, as torch's int4 kernels take them (the activations' dtype; bf16 on
        CUDA, which rounds the fp16 values to bf16's 8-bit mantissa there)."""
        return self._scales_in(self.grids(), dtype)

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
            gemv = self.__dict__["_gemv"] = gemv_layout(q, self.grids(), self.spec.group_size)
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
