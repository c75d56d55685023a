"""fp8 (e4m3) weights per output channel as a ``QuantLinear``, on ``torch._scaled_mm``."""

from __future__ import annotations

import torch
from torch import Tensor

from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import FP8_DTYPE, FP8_MAX, quantize_per_channel_fp8


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
