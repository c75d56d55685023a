"""`mcp2026 serve` options and the serve YAML: --quant, --kv-*, --gate, traffic/kv_compressor sections,
and which pressure gate a loaded pipeline gets."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from mcp2026.cli import app
from mcp2026.config import EngineConfig, KVConfig
from mcp2026.kv.compressor import KVCompressor
from mcp2026.serve.config import kv_compressor_from_options, load_quant_config, load_serve_yaml
from mcp2026.serve.server import pick_gate
from mcp2026.serve.traffic import KVPolicyGate, ObserveGate


def test_kv_options_build_a_compressor():
    engine = EngineConfig(KVConfig(block_size=32))
    assert kv_compressor_from_options(engine, None, None, None) is None
    only_dtype = kv_compressor_from_options(engine, "int8", None, None)
    assert (only_dtype.dtype, only_dtype.policy, only_dtype.block_size) == ("int8", "none", 32)
    evicting = kv_compressor_from_options(engine, None, "sink_window", 0.5)
    assert (evicting.policy, evicting.sparsity_ratio) == ("sink_window", 0.5)
    with pytest.raises(ValueError, match="--kv-policy"):
        kv_compressor_from_options(engine, "int8", None, 0.5)
    base = EngineConfig(kv_compressor=KVCompressor(dtype="fp8", policy="heavy_hitter", sparsity_ratio=0.3))
    merged = kv_compressor_from_options(base, None, None, 0.6)
    assert (merged.dtype, merged.policy, merged.sparsity_ratio) == ("fp8", "heavy_hitter", 0.6)


def test_kv_layer_weights_option():
    engine = EngineConfig()
    chosen = kv_compressor_from_options(engine, None, "heavy_hitter", None, "smollm2-135m")
    assert chosen.policy == "heavy_hitter" and len(chosen.layer_weights) == 30
    assert kv_compressor_from_options(engine, None, "snap", None, "1/2").layer_weights == (1.0, 2.0)
    with pytest.raises(ValueError, match="--kv-policy"):
        kv_compressor_from_options(engine, "int8", None, None, "1/2")
    # --kv-policy none over a YAML compressor with weights drops them, as it drops the budget
    base = EngineConfig(kv_compressor=KVCompressor(policy="heavy_hitter", layer_weights=(1.0, 2.0)))
    assert kv_compressor_from_options(base, None, "none", None).layer_weights is None


def test_kv_dtype_option_takes_the_codecs_block_size_unless_one_was_set(tmp_path):
    plain = EngineConfig()
    int4 = kv_compressor_from_options(plain, "int4", None, None)
    assert int4.block_size == 32  # int4's key group
    engine = dataclasses.replace(plain, kv_compressor=int4)
    assert engine.block_size == 32 and engine.resolved_kv.block_size == 32 and plain.block_size == 16
    # a block size the YAML's kv section set is kept, 16 too; so is a compressor's own, unless it was its
    # codec's default and the codec changes
    for block in (16, 64):
        (tmp_path / "s.yaml").write_text(f"kv: {{block_size: {block}}}\n")
        _, yaml_engine = load_serve_yaml(tmp_path / "s.yaml")
        chosen = kv_compressor_from_options(yaml_engine, "int4", None, None)
        assert chosen.block_size == block
        assert dataclasses.replace(yaml_engine, kv_compressor=chosen).block_size == block
    base = EngineConfig(kv_compressor=KVCompressor(dtype="int8", policy="none"))
    assert kv_compressor_from_options(base, "int4", None, None).block_size == 32
    pinned = EngineConfig(kv_compressor=KVCompressor(dtype="int4", policy="none", block_size=16))
    assert kv_compressor_from_options(pinned, None, "sink_window", 0.5).block_size == 16


def test_serve_yaml_sections(tmp_path):
    (tmp_path / "q.yaml").write_text("target_precision: int8\ngranularity: per_channel\n")
    (tmp_path / "serve.yaml").write_text(
        "quant: q.yaml\n"
        "traffic: {gate: observe, long_context_tokens: 1024}\n"
        "kv_compressor: {dtype: int8, policy: sink_window, sparsity_ratio: 0.5}\n"
    )
    serve, engine = load_serve_yaml(tmp_path / "serve.yaml")
    assert serve.quant == str(tmp_path / "q.yaml")
    assert serve.traffic.gate == "observe" and serve.traffic.long_context_tokens == 1024
    assert engine.kv_compressor.policy == "sink_window"
    quant = load_quant_config(serve.quant)
    assert (quant.target_precision, quant.granularity) == ("int8", "per_channel")
    (tmp_path / "bad.yaml").write_text("traffic: {gate: sometimes}\n")
    with pytest.raises(ValueError, match="gate"):
        load_serve_yaml(tmp_path / "bad.yaml")
    assert engine.speculative.method == "ngram"  # on unless the YAML says otherwise


def test_serve_yaml_speculative_section(tmp_path):
    (tmp_path / "s.yaml").write_text("speculative: {method: off, num_tokens: 3}\n")
    _, engine = load_serve_yaml(tmp_path / "s.yaml")
    assert (engine.speculative.method, engine.speculative.num_tokens) == ("off", 3)
    (tmp_path / "bad.yaml").write_text("speculative: {method: ngram, lookahead: 3}\n")
    with pytest.raises(ValueError, match="speculative section"):
        load_serve_yaml(tmp_path / "bad.yaml")
    (tmp_path / "bad2.yaml").write_text("speculative: {method: eagle}\n")
    with pytest.raises(ValueError, match="SpeculativeConfig.method"):
        load_serve_yaml(tmp_path / "bad2.yaml")


def test_pick_gate():
    from mcp2026.kv.manager import KVCacheManager

    evictor = KVCompressor(policy="sink_window", sparsity_ratio=0.5).make_evictor(KVCacheManager(16, 8), 256)
    plain = SimpleNamespace(engine=SimpleNamespace(evictor=None))
    evicting = SimpleNamespace(engine=SimpleNamespace(evictor=evictor))
    quant_gate = ObserveGate()
    with_quant = SimpleNamespace(engine=SimpleNamespace(evictor=evictor), gate=quant_gate)
    assert isinstance(pick_gate("auto", plain, 0.8), ObserveGate)
    assert isinstance(pick_gate("auto", evicting, 0.8), KVPolicyGate)
    assert pick_gate("auto", with_quant, 0.8) is quant_gate
    assert pick_gate("off", evicting, 0.8) is None
    with pytest.raises(ValueError, match="--kv-policy"):
        pick_gate("kv", plain, 0.8)
    with pytest.raises(ValueError, match="pressure_bits_budget"):
        pick_gate("quant", evicting, 0.8)


def test_cli_passes_quant_kv_and_gate(tmp_path, monkeypatch):
    import mcp2026.serve.cli as serve_cli

    seen = {}

    def fake_build(serve_config, engine_config, log_level="info"):
        seen.update(serve=serve_config, engine=engine_config)
        return SimpleNamespace(run=lambda: None)

    monkeypatch.setattr(serve_cli, "build_server", fake_build)
    quant = tmp_path / "q.yaml"
    quant.write_text("target_precision: int4\ngroup_size: 32\n")
    args = ["serve", "--quant", str(quant), "--kv-dtype", "int8", "--kv-policy", "heavy_hitter"]
    result = CliRunner().invoke(
        app, [*args, "--kv-sparsity", "0.6", "--gate", "kv", "--log-level", "warning"]
    )
    assert result.exit_code == 0, result.output
    assert seen["serve"].quant == str(quant) and seen["serve"].traffic.gate == "kv"
    compressor = seen["engine"].kv_compressor
    assert (compressor.dtype, compressor.policy, compressor.sparsity_ratio) == ("int8", "heavy_hitter", 0.6)
    bad = CliRunner().invoke(app, ["serve", "--kv-sparsity", "0.5"])
    assert bad.exit_code == 2 and "--kv-policy" in bad.output
