"""The base of the quantized linears: y = x @ dequantize().T + bias in a ``compute_dtype``, built from an
``nn.Linear`` and a ``LayerQuantSpec``. Each weight format is one subclass in its own module (``linear`` has the
registry)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from mcp2026.quant.plan import LayerQuantSpec
from mcp2026.quant.quantizer import DENSE_DTYPES, correction_bias, mse_clip_ratios


class QuantLinear(nn.Module):
    """Base of the quantized linears: y = x @ dequantize().T + bias, computed in ``compute_dtype``.

    NOTE: the input is cast to ``compute_dtype`` and the output back only when they differ: two
    elementwise copies, paid where the int kernels run much faster with bf16 than with fp32 activations
    (``backend.probe`` measures it and records the compute dtype per format).
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
            linear.in_features, linear.out_features, spec, has_bias(linear, spec), compute_dtype or w.dtype
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

    # NOTE: Python-side checks instead of no-op tensor calls: at batch 1 every dispatch counts.
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

    def _output(self, y: Tensor, x: Tensor, bias_added: bool = False) -> Tensor:
        """y in x's dtype and leading shape, the bias added (``bias_added``: the kernel already did)."""
        if self.bias is not None and not bias_added:
            y = y + self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _drop_kernel_copies(self) -> None:
        """Forget what was derived from the weights for the kernels (GEMV layouts, the fused-layer handle)."""
        for key in ("_gemv", "_gemm", "_gemv_scales", "_fused", "_cuda", "_torch_scales"):
            self.__dict__.pop(key, None)

    def _scales_in(self, scales: Tensor, dtype: torch.dtype) -> Tensor:
        """``scales`` in ``dtype`` (torch's kernels take them in the activations' dtype), converted on first use
        and kept beside the stored ones until the weights change."""
        if dtype == scales.dtype:
            return scales
        cached = self.__dict__.get("_torch_scales")
        if cached is None or cached.dtype != dtype:
            cached = self.__dict__["_torch_scales"] = scales.to(dtype)
        return cached

    def _clip(self, w: Tensor) -> float | Tensor:
        return mse_clip_ratios(w, self.spec) if self.spec.clip_ratio == "mse" else self.spec.clip_ratio

    def dequantize(self) -> Tensor:
        """The fp32 (N, K) weight this module computes with: forward(x) ~= x @ dequantize().T + bias."""
        w = self._quantized()
        return w if self.inv_act_scale is None else w * self.inv_act_scale

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight (fp16 scales/zeros), as in ``LayerQuantSpec.bits_per_weight``."""
        return self.spec.bits_per_weight(self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes this module holds now (scales are fp32 when the kernel runs in fp32)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.spec.format}, g={self.spec.group_size}, compute={self.compute_dtype}"


def has_bias(linear: nn.Linear, spec: LayerQuantSpec) -> bool:
    """Whether the module for ``linear`` stored as ``spec`` holds a bias (its own, or a correction)."""
    return linear.bias is not None or spec.bias_correction is not None
