"""int8 in groups of 32 (GGUF's Q8_0 form): the quantizer, the module on the block GEMM that runs stored Q8_0
blocks, its state dict, and how a QuantConfig asks for it."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import QuantConfig
from mcp2026.quant import recipe
from mcp2026.quant.block_linear import BlockLinear, BlockWeights
from mcp2026.quant.int8_group_linear import Int8GroupLinear
from mcp2026.quant.linear import build_linear, empty_module
from mcp2026.quant.plan import LayerQuantSpec, linear_modules
from mcp2026.quant.quantizer import dequantize_groupwise_int8, fake_quantize, quantize_groupwise_int8
from mcp2026.quant.uniform_plan import fitted_spec

from conftest import tiny_random_model

pytestmark = pytest.mark.usefixtures("one_thread")

G32 = LayerQuantSpec("int8", 32)


def test_groupwise_int8_is_q8_0_with_an_fp16_scale():
    w = torch.randn(16, 96) * torch.linspace(0.1, 3, 96)
    q, scales = quantize_groupwise_int8(w, 32)
    assert q.dtype == torch.int8 and scales.shape == (16, 3) and int(q.abs().max()) == 127
    peak = w.reshape(16, 3, 32).abs().amax(-1)
    assert torch.equal(scales, (peak / 127).to(torch.float16).float())
    assert (
        (dequantize_groupwise_int8(q, scales) - w).abs() <= scales.repeat_interleave(32, 1) / 2 + 1e-6
    ).all()
    per_channel = fake_quantize(w, LayerQuantSpec("int8"))
    assert (fake_quantize(w, G32) - w).pow(2).sum() < 0.7 * (per_channel - w).pow(
        2
    ).sum()  # channels vary in K
    assert G32.bits_per_weight(96) == 8.5 and G32.describe() == "int8 g32"


def test_module_runs_the_block_gemm_of_stored_q8_0_blocks(kernels):
    linear = torch.nn.Linear(96, 48, bias=True)
    module = build_linear("proj", linear, G32)
    assert isinstance(module, Int8GroupLinear) and module.kernel_on(torch.device("cpu")) == "block_gemm"
    w = module.dequantize()
    blocks = BlockWeights((module.weight.short() + 128).byte(), module.scales.float(), -128 * module.scales.float(),
                          32, 8, ("q8_0",))  # fmt: skip
    stored = BlockLinear(blocks, linear.bias.detach())
    x = torch.randn(37, 96)
    with torch.inference_mode():
        y = module(x)
        assert torch.equal(y, stored(x))  # the same kernel on the same blocks
        reference = x @ w.T + linear.bias.detach()
        assert ((y - reference).norm() / reference.norm()).item() < 0.01  # int8 activations per 32 values
        restored = empty_module(linear, G32, torch.float32)
        restored.load_state_dict(module.state_dict())
        assert torch.equal(restored(x), y)


def test_per_group_int8_config_gives_g32_where_the_tiles_fit():
    model = tiny_random_model()[0]
    result = recipe.plan_for_config(
        model,
        None,
        QuantConfig(target_precision="int8", granularity="per_group"),
        formats=("fp32", "int8", "int4"),
    )
    assert set(result.plan.layer_specs(model).values()) == {G32}
    assert fitted_spec(torch.nn.Linear(48, 32), G32) == LayerQuantSpec("int8")  # K not in 32s: per channel
    assert set(result.plan.layer_specs(model)) == {n for n, _ in linear_modules(model)}
    with pytest.raises(ValueError, match="int8 group_size must be None"):
        LayerQuantSpec("int8", 64)
    with pytest.raises(ValueError, match="int8 per_group stores groups of 32"):
        QuantConfig(target_precision="int8", granularity="per_group", group_size=64)
