"""Re-quantizing a model whose weights a GGUF stored on a 4-bit or 8-bit grid to that same grid is lossless: our
int4 (asymmetric: Q4_1's form; symmetric: Q4_0's) and grouped int8 (Q8_0's) keep fp16 scales, as the file does."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_group_linear import Int8GroupLinear
from mcp2026.quant.plan import LayerQuantSpec

from gguf_files import write_tiny_gguf

CASES = {
    "Q4_1": (Int4Linear, LayerQuantSpec("int4", group_size=32, symmetric=False)),
    "Q4_0": (Int4Linear, LayerQuantSpec("int4", group_size=32, symmetric=True)),
    "Q8_0": (Int8GroupLinear, LayerQuantSpec("int8", 32)),
}


@pytest.mark.parametrize("stored", sorted(CASES))
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_grid_requantized_to_the_same_grid_gives_the_same_weights(tmp_path, stored, compute_dtype):
    path = write_tiny_gguf(tmp_path / f"{stored}.gguf", stored, tie=False, full_range=True)
    model = load_model(path, torch.float32).model  # the file's own dequantization, in fp32
    cls, spec = CASES[stored]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the output
    for name, linear in linears.items():
        module = cls.from_linear(linear, spec, compute_dtype)
        assert torch.equal(module.dequantize(), linear.weight), name
