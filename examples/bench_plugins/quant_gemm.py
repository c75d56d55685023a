"""QBench plugin: one quantized linear at a time, our VNNI GEMMs against the routing a CPU without them takes
(the GEMVs, dequantize + GEMM, torch's int kernels) and against the fp32 weight, on the default model's
shapes. The per-layer figures in quant/linear.py (INT4_GEMM, INT8_GEMM) and docs/architecture.md come from it:

    mcp2026 bench plugin examples/bench_plugins/quant_gemm.py:QuantGemm --param rows=1,32,512

Parameters (``--param KEY=VALUE``): rows (comma list, default 1,32,512), formats (int8,int4), layers
(qkv,o,gate_up,down: SmolLM2-135M's 576 -> 960 / 576 -> 576 / 576 -> 3072 / 1536 -> 576), repeats (20; the
median is reported; the three paths alternate within every repeat, so machine noise hits them alike).

Metrics, per format, layer and row count, in ms: ``{fmt}_{layer}_{rows}_ms_gemm`` (where built), ``..._ms_fallback``
(the layer as it routes without the GEMMs), ``..._ms_dequant_fp32`` (dequantize + fp32 GEMM, per call), ``..._ms_fp32``
(the float weight); and ``..._rel_err_gemm`` (against x @ the dequantized weight). No model is loaded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from mcp2026.bench.plugins import PluginContext
from mcp2026.kernels import cpu, ops
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.plan import LayerQuantSpec

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
FORMATS = {"int8": (Int8Linear, LayerQuantSpec("int8")), "int4": (Int4Linear, LayerQuantSpec("int4", 32))}


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


class QuantGemm:
    def init(self, ctx: PluginContext) -> None:
        self.rows = [int(r) for r in _split(ctx.param("rows", "1,32,512"))]
        self.formats = _split(ctx.param("formats", "int8,int4"))
        self.layers = _split(ctx.param("layers", ",".join(SHAPES)))
        self.repeats = int(ctx.param("repeats", "20"))
        unknown = (set(self.formats) - set(FORMATS)) | (set(self.layers) - set(SHAPES))
        if unknown or self.repeats < 1 or min(self.rows, default=0) < 1:
            raise ValueError(
                f"formats from {list(FORMATS)}, layers from {list(SHAPES)}, rows and repeats >= 1 "
                f"(unknown: {sorted(unknown)})"
            )
        module = cpu.load()
        self.has_gemm = module is not None and ops.has_vnni_gemm(module)
        self.seed = ctx.seed

    def run(self, ctx: PluginContext) -> dict[str, float]:
        out: dict[str, float] = {}
        for fmt in self.formats:
            cls, spec = FORMATS[fmt]
            for name in self.layers:
                k, n = SHAPES[name]
                torch.manual_seed(self.seed)
                dense = torch.nn.Linear(k, n, bias=False)
                layer = cls.from_linear(dense, spec, torch.float32)
                weight = layer.dequantize()
                for rows in self.rows:
                    x = torch.randn(rows, k)
                    paths = {"fallback": lambda x=x, layer=layer: _without_gemm(layer, x)}
                    paths["dequant_fp32"] = lambda x=x, layer=layer: torch.nn.functional.linear(
                        x, layer.dequantize()
                    )
                    paths["fp32"] = lambda x=x, w=dense.weight: torch.nn.functional.linear(x, w)
                    if self.has_gemm:
                        paths["gemm"] = lambda x=x, layer=layer: layer(x)
                        exact = x @ weight.T
                        err = (layer(x) - exact).norm() / exact.norm()
                        out[f"{fmt}_{name}_{rows}_rel_err_gemm"] = float(err)
                    for path, ms in _median_ms(paths, self.repeats).items():
                        out[f"{fmt}_{name}_{rows}_ms_{path}"] = ms
        return out


def _without_gemm(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    real = ops.vnni_gemm_kernels
    ops.vnni_gemm_kernels = lambda _x: None  # as on a CPU without AVX-512 VNNI
    try:
        return layer(x)
    finally:
        ops.vnni_gemm_kernels = real


def _median_ms(paths: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {p: [] for p in paths}
    with torch.inference_mode():
        for fn in paths.values():  # warm-up: layouts built, caches filled
            fn()
        for _ in range(repeats):
            for path, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[path].append((time.perf_counter() - t0) * 1e3)
    return {p: statistics.median(t) for p, t in times.items()}
