"""QuantPlan: pattern matching, JSON round trip, stable plan_id, size accounting, table rendering."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from torch import nn

from mcp2026.quant.plan import LayerQuantSpec, QuantPlan
from mcp2026.quant.stats import model_weight_stats


def _plan() -> QuantPlan:
    return QuantPlan(
        {
            "layers.*.mlp.down_proj": LayerQuantSpec("int4", group_size=128, clip_ratio="mse"),
            "layers.*.mlp.*": LayerQuantSpec("int4", group_size=32, act_scale="mlp_in"),
            "lm_head": "int8",
            "_default": LayerQuantSpec("int4", group_size=64, symmetric=True, clip_ratio=0.9),
        }
    )


def test_spec_for_first_match_then_default():
    plan = _plan()
    assert plan.spec_for("layers.3.mlp.down_proj").group_size == 128
    assert plan.spec_for("layers.3.mlp.gate_up_proj").act_scale == "mlp_in"
    assert plan.spec_for("lm_head").format == "int8"
    assert plan.spec_for("layers.0.attn.qkv_proj").group_size == 64
    assert QuantPlan({"lm_head": "int8"}).spec_for("layers.0.attn.o_proj") is None


def test_json_round_trip_and_stable_plan_id():
    plan = _plan()
    again = QuantPlan.from_json(plan.to_json())
    assert again == plan and again.rules == plan.rules and again.default == plan.default
    assert again.plan_id == plan.plan_id == _plan().plan_id
    assert len(plan.plan_id) == 16
    changed = QuantPlan({**plan.to_dict(), "lm_head": "int4"})
    assert changed.plan_id != plan.plan_id
    reordered = QuantPlan(dict(reversed(list(plan.to_dict().items()))))
    assert reordered.plan_id != plan.plan_id  # first match wins, so order is content


def test_unknown_format_lists_known_formats():
    with pytest.raises(
        ValueError, match=r"unknown weight format 'int3'; known formats: fp32, bf16, fp16, fp8, int8, int4"
    ):
        LayerQuantSpec("int3")
    with pytest.raises(ValueError, match="unknown weight format"):
        QuantPlan({"_default": {"format": "nf4"}})


def test_spec_validation_and_normalization():
    assert (
        LayerQuantSpec("int8", group_size=32).group_size == 32 and LayerQuantSpec("int8").group_size is None
    )
    with pytest.raises(ValueError, match="int8 group_size must be None"):
        LayerQuantSpec("int8", group_size=64)  # the block GEMM keeps a scale per 32 values
    assert LayerQuantSpec("int8").symmetric and LayerQuantSpec("int4").group_size == 32
    with pytest.raises(ValueError, match="group_size"):
        LayerQuantSpec("int4", group_size=48)
    with pytest.raises(ValueError, match="clip_ratio"):
        LayerQuantSpec("int4", clip_ratio=1.5)
    with pytest.raises(ValueError, match="not quantized"):
        LayerQuantSpec("bf16", act_scale="x")


def test_8_bit_scales_apply_to_int4_with_zero_points_and_keep_old_plan_ids():
    spec = LayerQuantSpec("int4", 64, scale_bits=8)
    assert spec.describe() == "int4 g64 asym, 8-bit scales" and spec.to_dict()["scale_bits"] == 8
    assert (
        "scale_bits" not in LayerQuantSpec("int4").to_dict()
    )  # plans from before 8-bit scales hash as before
    plan = QuantPlan({"_default": spec})
    assert (
        QuantPlan.from_json(plan.to_json()) == plan
        and plan.plan_id != QuantPlan({"_default": "int4"}).plan_id
    )
    for bad in (
        {"format": "int4", "symmetric": True},
        {"format": "int8"},
        {"format": "int4", "method": "learned"},
    ):
        with pytest.raises(ValueError, match="scale_bits|learned scales are fp16"):
            LayerQuantSpec(**bad, scale_bits=8)
    with pytest.raises(ValueError, match="scale_bits must be one of"):
        LayerQuantSpec("int4", scale_bits=4)


def test_bits_per_weight_counts_scales_and_zeros():
    assert LayerQuantSpec("int4", group_size=32).bits_per_weight(576) == 5.0
    assert LayerQuantSpec("int4", group_size=64).bits_per_weight(576) == 4.5
    assert LayerQuantSpec("int4", group_size=128).bits_per_weight(1536) == 4.25
    # 8-bit scale and zero codes per group, two 8-bit exponents per row
    assert LayerQuantSpec("int4", 32, scale_bits=8).bits_per_weight(576) == pytest.approx(4.5 + 16 / 576)
    assert LayerQuantSpec("int4", 64, scale_bits=8).bits_per_weight(1536) == pytest.approx(4.25 + 16 / 1536)
    assert LayerQuantSpec("int8").bits_per_weight(576) == pytest.approx(8.0278, abs=1e-4)
    assert LayerQuantSpec("bf16").bits_per_weight(576) == 16.0


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.proj = nn.Linear(64, 128, bias=False)
        self.lm_head = nn.Linear(64, 100, bias=False)
        self.lm_head.weight = self.embed.weight


def test_size_accounting_with_tied_embedding():
    model = _Tied()
    fp32_bytes = (100 * 64 + 64 * 128) * 4  # the tied weight once
    assert QuantPlan({}).total_bytes(model) == fp32_bytes
    assert QuantPlan({}).avg_bits_per_weight(model) == 32.0
    plan = QuantPlan({"proj": LayerQuantSpec("int4", group_size=32), "lm_head": "int8"})
    int4_bytes = 64 * 128 * 5 / 8
    int8_bytes = 100 * 64 * (8 + 16 / 64) / 8
    # the embedding keeps its fp32 copy; the quantized lm_head adds its own
    assert plan.total_bytes(model) == int(int4_bytes + int8_bytes) + 100 * 64 * 4
    expected_bits = (64 * 128 * 5 + 100 * 64 * (8 + 16 / 64)) / (64 * 128 + 100 * 64)
    assert plan.avg_bits_per_weight(model) == pytest.approx(expected_bits)


def test_table_renders_rules_and_stats():
    plan = _plan()
    console = Console(width=200, record=True)
    console.print(plan.to_table())
    text = console.export_text()
    assert "layers.*.mlp.down_proj" in text and "_default" in text and plan.plan_id in text
    model = nn.Module()
    model.lm_head = nn.Linear(16, 8)
    torch.manual_seed(0)
    console.print(plan.to_table(model_weight_stats(model)))
    text = console.export_text()
    assert "lm_head" in text and "kurtosis" in text


def test_only_linears_are_counted():
    class HasDequantize(nn.Module):  # e.g. transformers' PreTrainedModel.dequantize
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 16, bias=False)

        def dequantize(self):
            return self

    model = HasDequantize()
    assert [name for name, _ in QuantPlan({}).layer_specs(model).items()] == ["proj"]
    assert QuantPlan({"proj": LayerQuantSpec("int4")}).avg_bits_per_weight(model) == 5.0
