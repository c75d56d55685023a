"""Dense weights (fp32 / bf16 / fp16) as a ``QuantLinear``, on ``kernels.ops.dense_linear``."""

from __future__ import annotations

import torch
from torch import Tensor

from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.plan import DENSE_FORMATS
from mcp2026.quant.quant_linear import QuantLinear


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
