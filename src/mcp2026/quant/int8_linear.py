"""int8 weights per output channel as a ``QuantLinear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mcp2026.kernels import gpu as kernel_gpu
from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant import cpu_routing as routing
from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import dequantize_per_channel_int8, quantize_per_channel_int8


class Int8Linear(QuantLinear):
    """Per-output-channel symmetric int8 weights: our int8 GEMM on AVX-512 VNNI CPUs (``kernels/int8_gemm.cpp``,
    every row count whose shape fits its tiles, activations in two int8 planes per 32 values), else our
    GEMV for decode-sized inputs and ``_weight_int8pack_mm`` (x @ q.T * scales) or dequantize + GEMM above."""

    formats = ("int8",)

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        # fp32 holds the quantizer's fp16-rounded scales exactly whatever the compute dtype (N values: no memory
        # to speak of); torch's kernel gets a copy in the activations' dtype
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))

    @classmethod
    def kernel_on(cls, device):
        if device.type == "cuda":
            return "triton int8 weight-only matmul" if kernel_gpu.load() is not None else None
        return "aten._weight_int8pack_mm" if device.type in ("cpu", "mps") else None

    def _load(self, w):
        self._drop_kernel_copies()
        self.weight, scales = quantize_per_channel_int8(w, self._clip(w))
        self.scales = scales.float()

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
            if (
                kernels is not None
            ):  # AVX-512 VNNI: our int8 x int8 GEMM at every row count (docs/quantization.md)
                return self._output(
                    kernels.int8_gemm(self._scaled(x2), self.gemm_weights(), self.gemv_scales()), x
                )
        if routing.gemv_rows(x2):
            kernels = kernel_ops.kernels_for(x2)
            if kernels is not None:  # decode: our int8-weight GEMV (float activations), no casts
                x2 = self._scaled(x2)
                return self._output(kernels.int8_gemv(x2, self.weight, self.gemv_scales()), x)
        if x2.shape[0] >= routing.DEQUANT_MIN_ROWS and routing.bf16_int_kernels_slow(x2):
            w = self.weight * self.scales.float().unsqueeze(1)  # one pass: int8 * fp32 -> fp32
            xs = self._scaled(x2)
            return self._output(kernel_ops.prefill_linear(xs, w), x)
        if self.in_features % routing.INT8PACK_K_MULTIPLE:
            y = F.linear(self._input(x), self._quantized().to(self.compute_dtype))
            return self._output(y, x)
        if self.weight.data_ptr() % routing.INT8PACK_ALIGN:  # mmapped from a file: one aligned copy
            self.weight = self.weight.clone()
        xs = routing.aligned(self._input(x))
        y = torch.ops.aten._weight_int8pack_mm(xs, self.weight, self.torch_scales(xs.dtype))
        return self._output(y, x)

    def torch_scales(self, dtype: torch.dtype) -> Tensor:
        """The scales in ``dtype``, as torch's int8 kernel takes them (the activations' dtype)."""
        return self._scales_in(self.scales, dtype)

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
