"""``mcp2026 kv calibrate``: the single-layer probe, the weights rule, the file, and ``"auto"`` taking it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mcp2026.bench.kv_calibrate import CalibrationConfig, calibrate, probe_layers, weights_from_probes
from mcp2026.bench.kv_measure import measurement_engine
from mcp2026.cli import app
from mcp2026.kv.compressor import KVCompressor
from mcp2026.kv.layer_weights import auto_weights, parse_layer_weights, read_weights_file
from mcp2026.loading.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP2026_CACHE_DIR", str(tmp_path / "cache"))  # installed calibrations land here


def random_text(tiny, n: int = 256) -> list[int]:
    import torch

    return torch.randint(3, tiny.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def test_a_probe_evicts_in_its_layer_exactly_as_the_uniform_engine_and_nowhere_else(tiny):
    """Layer 0's attention sees the same inputs and its own kept blocks only, so probing it must keep, lane by
    lane, what uniform eviction keeps there; every other layer keeps the whole context."""
    kv = KVCompressor(dtype="fp32", policy="heavy_hitter", sparsity_ratio=0.5, recent_window=16)
    uniform = measurement_engine(tiny, kv, 256, None)
    probe = measurement_engine(tiny, KVCompressor(**{**kv.to_dict(), "layer_weights": (1.0, 1.0)}), 256, None)
    probe.evictor.probe_layer = 0
    nkv, tokens = tiny.config.num_kv_heads, random_text(tiny)
    checked = 0
    for (start, _), _ in zip(uniform.score(tokens, 128, 64, 16, "a"), probe.score(tokens, 128, 64, 16, "b")):
        n = len(uniform.kv_manager.block_table("a"))
        end = start + (64 if start < 128 else 16)
        whole = list(range(-(-end // 16)))  # every block so far
        if uniform.evictor.counters.num_evicted_blocks == 0:
            continue
        kept = uniform.evictor.lane_origins("a", n)[:nkv]
        lanes = probe.evictor.lane_origins("b", len(probe.kv_manager.block_table("b")))
        assert lanes[:nkv] == kept
        assert all(lane == whole for lane in lanes[nkv:])
        checked += 1
    assert checked > 3


def test_weights_rule():
    # shares per text: (0.75, 0.25, 0) and (0.5, 0.5, 0); summed 1.25, 0.75, floored 0.01 for two texts
    weights = weights_from_probes([[3.0, 1.0, -2.0], [1.0, 1.0, 0.0]])
    assert weights == pytest.approx((1.25**0.5, 0.75**0.5, 0.01**0.5), rel=1e-5)


def test_calibrate_measures_every_layer_and_the_file_round_trips(tiny, tmp_path):
    config = CalibrationConfig(sparsity=0.5, context_tokens=256, num_texts=2, text="random")
    result = calibrate(tiny, config, "tiny")
    probes = result["probes_delta_ppl_pct"]
    assert len(probes) == 2 and all(len(p) == tiny.config.num_layers for p in probes)
    assert all(abs(d) > 0 for p in probes for d in p)  # each layer's eviction changes the text's perplexity
    assert result["weights"] == list(weights_from_probes(probes))
    # in groups of one engine per pass, the same probes
    texts = [random_text(tiny)]
    assert probe_layers(tiny, config, texts, group=1) == probe_layers(tiny, config, texts)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(result))
    assert parse_layer_weights(str(path)) == tuple(result["weights"])
    assert KVCompressor(policy="heavy_hitter", layer_weights=str(path)).layer_weights == tuple(
        result["weights"]
    )


def test_the_command_writes_and_installs_for_auto(tiny, tiny_llama_dir, tmp_path):
    out = tmp_path / "tiny-weights.json"
    args = ["kv", "calibrate", "--model", str(tiny_llama_dir), "--text", "random", "--context-tokens", "256"]
    args += ["--texts", "1", "--sparsity", "0.5", "--out", str(out), "--install", "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = read_weights_file(out)
    assert "per-layer sensitivity" in result.output and "installed" in result.output
    assert auto_weights(tiny.config, "heavy_hitter")[1] == tuple(data["weights"])
    assert KVCompressor(policy="heavy_hitter").for_model(tiny.config).layer_weights == tuple(data["weights"])
    assert auto_weights(tiny.config, "snap") is None  # calibrated for heavy_hitter only


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sparsity", "1.5"], "--sparsity must be in"),
        (["--policy", "lru"], "--policy must be one of"),
        (["--text", "/no/such.txt"], "no such file"),
        (["--out", "w.txt"], "--out must name a .json file"),
    ],
)
def test_command_errors(tiny_llama_dir, args, message):
    result = CliRunner().invoke(
        app, ["kv", "calibrate", "--model", str(tiny_llama_dir), *args, "--no-progress"]
    )
    assert result.exit_code == 2 and message in result.output


def test_bad_weights_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        parse_layer_weights(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"weights": [1, 2]}')
    with pytest.raises(ValueError, match="not a layer-weights file"):
        parse_layer_weights(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        parse_layer_weights(str(bad))


def test_calibration_texts_from_a_file(tmp_path, default_model_path):
    from types import SimpleNamespace

    from mcp2026.bench.kv_calibrate import calibration_texts
    from mcp2026.loading.tokenizer import Tokenizer

    loaded = SimpleNamespace(tokenizer=Tokenizer.from_gguf(default_model_path), config=None)
    text = tmp_path / "traffic.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    windows = calibration_texts(loaded, CalibrationConfig(context_tokens=128, num_texts=3, text=str(text)))
    assert [len(w) for w in windows] == [128] * 3 and windows[0] != windows[1]
    with pytest.raises(ValueError, match="need 1280"):
        calibration_texts(loaded, CalibrationConfig(context_tokens=128, num_texts=10, text=str(text)))
