"""QuantConfig -> uniform plan: the output projection's format (int8 under int4 by default, pinned on request)."""

from __future__ import annotations

import pytest

from mcp2026.config import QuantConfig
from mcp2026.quant import recipe
from mcp2026.quant.compile_cli import parse_spec
from mcp2026.quant.plan import LayerQuantSpec

from conftest import tiny_random_model

FORMATS = ("fp32", "int8", "int4")


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(tie_word_embeddings=True)[0]


def _plan(model, **fields):
    return recipe.plan_for_config(model, None, QuantConfig(**fields), formats=FORMATS, progress=False)


def test_int4_keeps_the_lm_head_int8_by_default(model):
    result = _plan(model, target_precision="int4", group_size=64, symmetric=True)
    specs = result.plan.layer_specs(model)
    assert specs.pop("lm_head") == LayerQuantSpec("int8")
    assert set(specs.values()) == {LayerQuantSpec("int4", 64, symmetric=True)}
    assert result.budget == "uniform int4, lm_head int8"


def test_lm_head_precision_pins_the_output_projection(model):
    all_int4 = _plan(model, target_precision="int4", lm_head_precision="int4").plan.layer_specs(model)
    assert set(all_int4.values()) == {LayerQuantSpec("int4", 32)}
    int8 = _plan(model, target_precision="int8").plan.layer_specs(model)
    assert set(int8.values()) == {LayerQuantSpec("int8")}
    head_only = _plan(model, target_precision="fp32", lm_head_precision="int8").plan.layer_specs(model)
    assert head_only.pop("lm_head") == LayerQuantSpec("int8") and set(head_only.values()) == {None}
    dense = _plan(model, target_precision="int4", lm_head_precision="fp32").plan.layer_specs(model)
    assert dense["lm_head"] == LayerQuantSpec("fp32")
    assert _plan(model, target_precision="fp32").plan.layer_specs(model)["lm_head"] is None
    assert QuantConfig(target_precision="fp32", lm_head_precision="int8").quantizes_weights


def test_lm_head_precision_is_validated_and_read_from_yaml():
    with pytest.raises(ValueError, match="lm_head_precision must be one of"):
        QuantConfig(lm_head_precision="int3")
    spec = parse_spec({"target_precision": "int4", "lm_head_precision": "int4"}, "q.yaml")
    assert spec.quant.lm_head_precision == "int4"
    with pytest.raises(ValueError, match=r"q.yaml: QuantConfig.lm_head_precision must be one of"):
        parse_spec({"lm_head_precision": "q8"}, "q.yaml")


def test_int4_keeps_the_lm_head_in_q8_0s_form_where_the_device_runs_grouped_int8(model):
    result = recipe.plan_for_config(
        model, None, QuantConfig(target_precision="int4"), formats=FORMATS, progress=False, grouped_int8=True
    )
    assert result.plan.spec_for("lm_head") == LayerQuantSpec("int8", 32)
    assert result.budget == "uniform int4, lm_head int8 g32"
    pinned = recipe.plan_for_config(
        model,
        None,
        QuantConfig(target_precision="int4", lm_head_precision="int8"),
        formats=FORMATS,
        progress=False,
        grouped_int8=True,
    )
    assert pinned.plan.spec_for("lm_head") == LayerQuantSpec("int8")  # a pinned "int8" stays per channel


def test_int4_scale_bits_8_gives_a_uniform_int4_target_8_bit_grids(model):
    specs = _plan(
        model, target_precision="int4", lm_head_precision="int4", int4_scale_bits=8
    ).plan.layer_specs(model)
    assert set(specs.values()) == {LayerQuantSpec("int4", 32, scale_bits=8)}
    spec = parse_spec({"target_precision": "int4", "int4_scale_bits": 8, "group_size": 64}, "q.yaml")
    assert spec.quant.int4_scale_bits == 8
    with pytest.raises(ValueError, match="int4_scale_bits must be 16"):
        QuantConfig(int4_scale_bits=4)
    with pytest.raises(ValueError, match="need symmetric=False"):
        QuantConfig(target_precision="int4", int4_scale_bits=8, symmetric=True)
