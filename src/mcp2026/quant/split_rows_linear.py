"""int4 weights with a chosen share of output rows in int8 (``LayerQuantSpec.high_rows``) as a ``QuantLinear``."""

from __future__ import annotations

import torch
from torch import Tensor

from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.plan import high_row_count
from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import _high_spec, _low_spec, split_rows


class SplitRowsLinear(QuantLinear):
    """int4 weights with a chosen share of output rows in int8 (``LayerQuantSpec.high_rows``): two real
    kernels (``Int8Linear`` for the chosen rows, ``Int4Linear`` for the rest) and one gather putting the
    outputs back in row order. For a vocabulary projection: most of what int4 noise on the logits costs sits on
    the few rows that carry the probability mass (docs/quantization.md, "Split rows")."""

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
