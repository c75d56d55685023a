"""int8 weights with one scale per group of 32 along K (GGUF's Q8_0 form, the scale in fp16) as a ``QuantLinear``,
run on the block GEMM that runs a GGUF's stored Q8_0 blocks (``block_linear``, ``kernels/block_gemm.cpp``)."""

from __future__ import annotations

import torch
from torch import Tensor

from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.block_linear import kernels_unavailable, pack_byte_tiles, packable, tile_scales
from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import SCALE_DTYPE, dequantize_groupwise_int8, quantize_groupwise_int8

_OFFSET = 128  # the block GEMM takes unsigned bytes: u = q + 128, w = scale * u - 128 * scale


class Int8GroupLinear(QuantLinear):
    """Symmetric int8 in groups of 32 input values, an fp16 scale each (8.5 bits per weight): q (N, K) int8 and
    scales (N, K/32). The block GEMM's copy (byte tiles, fp16 scale and offset per group) is built on first use;
    its activations are rounded to int8 per 32 values, as llama.cpp's Q8_0 x Q8_0 dot products do."""

    formats = ()  # chosen by ``linear.linear_class`` for an int8 spec with a group size

    def __init__(self, in_features, out_features, spec, bias, compute_dtype):
        if not packable((out_features, in_features)):
            raise ValueError(
                f"grouped int8 runs on the block GEMM's tiles: out_features={out_features} must be a multiple of "
                f"16 and in_features={in_features} of 32"
            )
        super().__init__(in_features, out_features, spec, bias, compute_dtype)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer(
            "scales", torch.empty(out_features, in_features // spec.group_size, dtype=SCALE_DTYPE)
        )

    @classmethod
    def kernel_on(cls, device):
        return "block_gemm" if device.type == "cpu" and kernels_unavailable() is None else None

    def _load(self, w):
        self._drop_kernel_copies()
        self.weight, scales = quantize_groupwise_int8(w, self.spec.group_size, self._clip(w))
        self.scales = scales.to(SCALE_DTYPE)  # exact: the quantizer rounds scales to SCALE_DTYPE

    def _quantized(self):
        return dequantize_groupwise_int8(self.weight, self.scales)

    def forward(self, x: Tensor) -> Tensor:
        x2 = self._scaled(x if x.dim() == 2 else x.reshape(-1, self.in_features))
        kernels = kernel_ops.kernels_for(x2)
        if kernels is None:
            raise RuntimeError(
                f"grouped int8 runs on the compiled CPU kernels only (CPU fp32/bf16 input, no autograd), got "
                f"{x2.dtype} on {x2.device}: {kernels_unavailable() or 'use int8 per channel there'}"
            )
        return self._output(kernels.block_gemm(x2, *self.gemm_weights(), self.bias), x, bias_added=True)

    def gemm_weights(self) -> tuple[Tensor, Tensor]:
        """The block GEMM's (N/16, K/4, 64) byte tiles (q + 128) and (N/16, K/32, 1, 16) scales (fp16: exact):
        symmetric, so the kernel takes each offset as -128 x its scale."""
        gemm = self.__dict__.get("_gemm")
        if gemm is None:
            u = (self.weight.to(torch.int16) + _OFFSET).to(torch.uint8).cpu()
            scale = self.scales.float().cpu()
            gemm = self.__dict__["_gemm"] = (pack_byte_tiles(u), tile_scales(scale))
        return gemm

    def _load_from_state_dict(self, *args, **kwargs):  # new weights: repack on next use
        self._drop_kernel_copies()
        super()._load_from_state_dict(*args, **kwargs)
