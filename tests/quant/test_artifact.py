"""Artifacts: save / load round trip with identical logits, metadata, tokenizer files, compile CLI errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mcp2026.cli import app
from mcp2026.config import QuantConfig
from mcp2026.loading.loader import load_model
from mcp2026.quant import artifact, dqg, recipe
from mcp2026.quant.compile_cli import load_spec, parse_spec
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan
from mcp2026.quant.quant_linear import QuantLinear

FORMATS = ("fp32", "int8", "int4")
DTYPES = {"int8": torch.bfloat16, "int4": torch.bfloat16}


@pytest.fixture(autouse=True)
def fixed_candidates(monkeypatch, one_thread):
    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, dict(DTYPES)))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


MIXED = QuantPlan({
    "layers.0.attn.qkv_proj": LayerQuantSpec("int8"),
    "layers.0.mlp.gate_up_proj": LayerQuantSpec("int4", 64, symmetric=True, act_scale="awq0"),
    "layers.1.attn.*": LayerQuantSpec("int4", 32, clip_ratio="mse"),
    "layers.1.mlp.*": LayerQuantSpec("int4", 32, scale_bits=8),
    "lm_head": LayerQuantSpec("fp32"),
    "_default": LayerQuantSpec("int4", 64),
})  # fmt: skip


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_gives_identical_logits(tmp_path, tie):
    from conftest import save_tiny_hf

    source = save_tiny_hf(tmp_path / "src", tie=tie)
    loaded = load_model(source)
    scales = {"awq0": torch.rand(64) + 0.5}
    plan = MIXED if not tie else QuantPlan({**MIXED.to_dict(), "lm_head": LayerQuantSpec("int8")})
    result = dqg.DQGResult("uniform", plan, scales)
    recipe.apply(loaded.model, result, DTYPES, progress=False)
    ids = torch.randint(320, (40,))
    expected = _logits(loaded.model, ids)
    out = artifact.save_artifact(tmp_path / "art", loaded, result, QuantConfig(target_precision="int4"))
    again = load_model(out)
    assert again.file_format == "mcp2026-artifact" and artifact.is_artifact(out)
    assert torch.equal(_logits(again.model, ids), expected)
    modules = dict(again.model.named_modules())
    assert isinstance(modules["layers.0.attn.qkv_proj"], Int8Linear)
    assert isinstance(modules["layers.0.mlp.down_proj"], Int4Linear)
    assert modules["layers.0.mlp.gate_up_proj"].inv_act_scale is not None
    if tie:
        assert isinstance(modules["lm_head"], Int8Linear)
    else:
        assert not isinstance(modules["lm_head"], QuantLinear)
    meta = json.loads((out / artifact.METADATA_FILE).read_text())
    assert meta["source"]["sha256"] == artifact.source_sha256(source)
    assert meta["plan_id"] == plan.plan_id and QuantPlan.from_json((out / "plan.json").read_text()) == plan
    assert meta["model_config"]["hidden_size"] == 64 and meta["quant_config"]["target_precision"] == "int4"


def _pack_as(q: torch.Tensor, block_rows: int) -> torch.Tensor:
    """q (N, K) in torch's packed int4 layout for a CPU with ``block_rows``-row blocks (not this one's)."""
    n, k = q.shape
    full = n // block_rows * block_rows
    halves = q[:full].view(n // block_rows, 2, block_rows // 2, k)
    parts = [(halves[:, 0] | halves[:, 1] << 4).permute(0, 2, 1).reshape(-1)]
    if n > full:
        pairs = q[full:].view((n - full) // 2, 2, k)
        parts.append((pairs[:, 0] | pairs[:, 1] << 4).t().reshape(-1))
    return torch.cat(parts).view(n, k // 2)


def test_artifact_from_the_other_kind_of_cpu_is_repacked(tmp_path, tiny_llama_dir):
    # torch packs int4 in 64-row blocks on AVX-512 and 32-row blocks on AVX2: an artifact compiled on the
    # other kind (its weights and recorded layout rewritten so) gives the same logits here.
    from safetensors.torch import load_file, save_file

    from mcp2026.quant.int4_packing import int4pack_block_rows, unpack_int4

    loaded = load_model(tiny_llama_dir)
    recipe.apply(
        loaded.model, dqg.DQGResult("uniform", MIXED, {"awq0": torch.rand(64) + 0.5}), DTYPES, progress=False
    )
    ids = torch.randint(320, (40,))
    expected = _logits(loaded.model, ids)
    out = artifact.save_artifact(tmp_path / "art", loaded, MIXED, QuantConfig(target_precision="int4"))
    other = 96 - int4pack_block_rows()  # 32 <-> 64
    state = load_file(str(out / artifact.WEIGHTS_FILE))
    for name, m in loaded.model.named_modules():
        if isinstance(m, Int4Linear):
            q = unpack_int4(m.weight, m.out_features, m.in_features)
            state[f"{name}.weight"] = _pack_as(q, other).contiguous()
    save_file(state, str(out / artifact.WEIGHTS_FILE), metadata={"format": artifact.FORMAT})
    meta = json.loads((out / artifact.METADATA_FILE).read_text())
    assert meta["int4_pack_block_rows"] == int4pack_block_rows()
    meta["int4_pack_block_rows"] = other
    (out / artifact.METADATA_FILE).write_text(json.dumps(meta))
    assert torch.equal(_logits(load_model(out).model, ids), expected)


def test_bf16_load_converts_only_dense_tensors(tmp_path, tiny_llama_dir):
    loaded = load_model(tiny_llama_dir)
    result = dqg.DQGResult("uniform", QuantPlan.uniform("int8"))
    recipe.apply(loaded.model, result, DTYPES, progress=False)
    out = artifact.save_artifact(tmp_path / "art", loaded, result)
    again = load_model(out, dtype=torch.bfloat16)
    assert again.model.embed_tokens.weight.dtype == torch.bfloat16
    assert again.model.lm_head.weight.dtype == torch.int8


def test_pipeline_loads_artifact_without_recalibrating(tmp_path, tiny_llama_dir, monkeypatch):
    from mcp2026 import Pipeline
    from mcp2026.quant import calibrate

    loaded = load_model(tiny_llama_dir)
    result = dqg.DQGResult("uniform", QuantPlan.uniform("int4", group_size=32))
    recipe.apply(loaded.model, result, DTYPES, progress=False)
    out = artifact.save_artifact(tmp_path / "art", loaded, result)
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("recalibrated"))
    pipe = Pipeline(model=out, dtype="fp32")
    assert isinstance(pipe.loaded.model.lm_head, Int4Linear) and pipe.quant_result is None


def test_tokenizer_files_round_trip(tmp_path, default_model_path):
    from mcp2026.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path)
    artifact.save_tokenizer(tokenizer, tmp_path)
    again = Tokenizer.from_hf_dir(tmp_path)
    text = "Hello world 2026!\n  code: def f(x): return x"
    assert again.encode(text) == tokenizer.encode(text)
    assert again.eos_token_ids == tokenizer.eos_token_ids and again.bos_token_id == tokenizer.bos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert again.encode_chat(chat) == tokenizer.encode_chat(chat)


# ---- compile: YAML and CLI ---------------------------------------------------------------------------
def test_example_configs_parse():
    from pathlib import Path

    examples = Path(__file__).parents[2] / "examples" / "quant"
    specs = {p.name: load_spec(p) for p in examples.glob("*.yaml")}
    assert set(specs) == {"w4a16_g32.yaml", "w8.yaml", "dqg_4.5bpw.yaml", "dqg_5bpw.yaml"}
    assert specs["w4a16_g32.yaml"].quant.target_precision == "int4"
    dqg_spec = specs["dqg_4.5bpw.yaml"]
    assert dqg_spec.quant.enable_dqg and dqg_spec.quant.bits_budget == 4.5
    assert dqg_spec.calibration.num_samples == 32 and dqg_spec.dqg.precompensation == "flagged"
    assert specs["dqg_5bpw.yaml"].quant.bits_budget == 5.0


def test_spec_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown keys \['bitz'\]"):
        parse_spec({"bitz": 4})
    with pytest.raises(ValueError, match="target_precision must be one of"):
        parse_spec({"target_precision": "int3"})
    with pytest.raises(ValueError, match=r"unknown keys in 'calibration': \['samples'\]"):
        parse_spec({"calibration": {"samples": 3}})
    with pytest.raises(ValueError, match="precompensation must be one of"):
        parse_spec({"dqg": {"precompensation": "sometimes"}})
    spec = parse_spec({"calibration_samples": 5, "symmetric": True})
    assert spec.calibration.num_samples == 5 and spec.dqg.symmetric_only


def _compile(tmp_path, model_dir, yaml_text: str, out: str = "art"):
    config = tmp_path / "quant.yaml"
    config.write_text(yaml_text)
    return CliRunner().invoke(
        app,
        ["compile", str(model_dir), "--config", str(config), "--out", str(tmp_path / out), "--no-progress"],
    )


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("target_precision: [int4\n", "invalid YAML (line"),
        ("target_precision: int3\n", "target_precision must be one of"),
        (
            "enable_dqg: true\nbits_budget: 2.5\ncalibration_source: random\ncalibration_samples: 2\n",
            "impossible budget",
        ),
        ("target_precision: bf16\n", "quantizes nothing"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_compile_errors_exit_2_without_traceback(tmp_path, tiny_llama_dir, yaml_text, message):
    result = _compile(tmp_path, tiny_llama_dir, yaml_text)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output + result.stderr


def test_compile_cli_writes_loadable_artifact(tmp_path, tiny_llama_dir):
    result = _compile(
        tmp_path,
        tiny_llama_dir,
        "enable_dqg: true\nbits_budget: 6\ncalibration:\n  source: random\n  num_samples: 2\n  max_len: 64\n"
        "  ema_decay: 0.9\n",
    )
    assert result.exit_code == 0, result.output + result.stderr
    out = tmp_path / "art"
    assert (out / artifact.REPORT_FILE).exists() and "bits/weight" in result.stdout
    report = json.loads((out / artifact.REPORT_FILE).read_text())
    assert report["avg_bits_per_weight"] <= 6 and report["mode"] == "measured"
    metadata = artifact.read_metadata(out)
    for recorded in (
        report["calibration"],
        metadata["calibration"],
    ):  # the settings the plan was measured with
        assert (
            recorded["ema_decay"] == 0.9 and recorded["num_samples"] == 2 and recorded["source"] == "random"
        )
    assert load_model(out).file_format == "mcp2026-artifact"
    again = _compile(tmp_path, tmp_path / "art", "target_precision: int8\n", out="art2")
    assert again.exit_code == 2 and "already a compiled artifact" in again.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x.txt").write_text("x")
    clash = _compile(tmp_path, tiny_llama_dir, "target_precision: int8\n", out="busy")
    assert clash.exit_code == 2 and "not an empty folder" in clash.stderr


def test_split_bias_corrected_lm_head_round_trips(tmp_path):
    from mcp2026.quant.split_rows_linear import SplitRowsLinear

    from conftest import save_tiny_hf

    source = save_tiny_hf(tmp_path / "src", tie=True)
    loaded = load_model(source)
    spec = LayerQuantSpec(
        "int4", 32, high_rows=0.2, row_scores="scores", bias_correction="mean", scale_bits=8
    )
    tensors = {"scores": torch.rand(320), "mean": torch.randn(64)}
    result = dqg.DQGResult(
        "uniform", QuantPlan({"lm_head": spec, "_default": LayerQuantSpec("int4", 64)}), tensors
    )
    recipe.apply(loaded.model, result, DTYPES, progress=False)
    ids = torch.randint(320, (40,))
    expected = _logits(loaded.model, ids)
    out = artifact.save_artifact(tmp_path / "art", loaded, result, QuantConfig(target_precision="int4"))
    again = load_model(out)  # rebuilt from the metadata alone: no scores or means needed to load
    head = again.model.lm_head
    assert isinstance(head, SplitRowsLinear) and head.bias is not None
    assert torch.equal(head.high_index, loaded.model.lm_head.high_index)
    assert torch.equal(_logits(again.model, ids), expected)
    assert again.model.embed_tokens.weight.dtype == torch.float32  # the tied embedding keeps its own copy
