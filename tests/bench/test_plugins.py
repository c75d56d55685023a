"""Benchmark plugins: the example plugin loads by module:Class, by file path and by entry point, runs on a
tiny model and records a BenchRun; broken plugins fail with one line naming the plugin."""

from __future__ import annotations

import json
import math
import sys
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mcp2026.bench.cli import bench_app
from mcp2026.bench.plugins import (
    ENTRY_POINT_GROUP,
    PluginContext,
    PluginError,
    available_plugins,
    load_plugin,
    run_plugin,
)

from conftest import save_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "bench_plugins"
EXAMPLE = "prefix_cache_hit:PrefixCacheHitRate"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_hf(tmp_path_factory.mktemp("tiny_plugin"), max_position_embeddings=256))


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_example_plugin_by_module_and_class(tiny_dir, examples_on_path):
    name, plugin = load_plugin(EXAMPLE)
    params = {"prefix_len": "64", "suffix_len": "8", "num_requests": "4", "output_len": "2"}
    ctx = PluginContext(model=tiny_dir, dtype="fp32", seed=3, params=params)
    run = run_plugin(name, plugin, ctx)
    metrics = run.aggregates["metrics"]
    # 3 later requests reuse the 4 full 16-token blocks of the 64-token prefix: 64 of their 72 tokens.
    assert metrics["ideal_hit_rate"] == pytest.approx(64 / 72)
    assert metrics["hit_rate"] == pytest.approx(64 / 72)
    assert metrics["passed"] == 1.0 and metrics["ttft_first_ms"] > 0 and metrics["ttft_cached_ms"] > 0
    assert run.kind == "plugin" and run.config["plugin"] == EXAMPLE and run.config["params"] == params
    assert {r["metric"] for r in run.records} == set(metrics)
    assert run.tables[0].rows[0][0] == "hit_rate" and run.aggregates["run_s"] > 0


def test_plugin_found_through_an_entry_point(monkeypatch, examples_on_path):
    point = metadata.EntryPoint(name="prefix-hit", value=EXAMPLE, group=ENTRY_POINT_GROUP)
    other = metadata.EntryPoint(name="elsewhere", value="os:path", group="another.group")

    def entry_points(**selection):
        return [ep for ep in (point, other) if ep.group == selection.get("group", ep.group)]

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    assert available_plugins() == {"prefix-hit": EXAMPLE}
    name, plugin = load_plugin("prefix-hit")
    assert name == "prefix-hit" and type(plugin).__name__ == "PrefixCacheHitRate"
    with pytest.raises(PluginError, match=r"no benchmark plugin named 'elsewhere' \(installed: prefix-hit\)"):
        load_plugin("elsewhere")


class ReturnsText:
    def init(self, ctx):
        pass

    def run(self, ctx):
        return {"speed": "fast"}


class Explodes:
    def init(self, ctx):
        raise ZeroDivisionError("boom")

    def run(self, ctx):
        return {"x": 1.0}


class NotAPlugin:
    pass


@pytest.mark.parametrize(
    "spec, phase_error",
    [
        (f"{__name__}:ReturnsText", "metric 'speed' is 'fast', not a finite number"),
        (f"{__name__}:Explodes", "failed in init(): ZeroDivisionError: boom"),
    ],
)
def test_bad_results_and_errors_name_the_plugin(spec, phase_error):
    name, plugin = load_plugin(spec)
    with pytest.raises(PluginError, match=rf"^plugin {spec}.*") as info:
        run_plugin(name, plugin, PluginContext())
    assert phase_error in str(info.value) and "\n" not in str(info.value)


def test_loading_errors():
    with pytest.raises(PluginError, match="needs methods init"):
        load_plugin(f"{__name__}:NotAPlugin")
    with pytest.raises(PluginError, match="has no attribute 'Missing'"):
        load_plugin(f"{__name__}:Missing")
    with pytest.raises(PluginError, match="cannot import no_such_module_xyz"):
        load_plugin("no_such_module_xyz:Thing")
    with pytest.raises(PluginError, match="is not a file"):
        load_plugin("missing/plugin.py:Thing")


def test_bench_plugin_command_by_file_path(tiny_dir, tmp_path):
    spec = f"{EXAMPLES / 'prefix_cache_hit.py'}:PrefixCacheHitRate"
    args = ["plugin", "--plugin", spec, "--model", tiny_dir, "--dtype", "fp32", "--param", "prefix_len=32"]
    args += ["--param", "num_requests=3", "--param", "suffix_len=4", "--out", str(tmp_path)]
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.glob("*-plugin.json")
    data = json.loads(path.read_text())
    assert data["aggregates"]["metrics"]["passed"] == 1.0
    assert "--param prefix_len=32" in data["command"] and path.with_suffix(".md").exists()
    assert "hit_rate" in result.output

    too_long = CliRunner().invoke(
        bench_app, ["plugin", spec, "--model", tiny_dir, "--param", "prefix_len=999"]
    )
    assert (
        too_long.exit_code == 2
        and "failed in init(): ValueError: prefix + suffix + output" in too_long.output
    )
    bad_param = CliRunner().invoke(bench_app, ["plugin", spec, "--param", "prefix_len"])
    assert bad_param.exit_code == 2 and "KEY=VALUE" in bad_param.output
    two = CliRunner().invoke(bench_app, ["plugin", spec, "--plugin", "other:Class"])
    assert two.exit_code == 2 and "two plugins given" in two.output


def test_eviction_simulation_plugin_masks_what_each_variant_drops(tiny_dir):
    spec = f"{EXAMPLES / 'kv_eviction_sim.py'}:EvictionSimulation"
    name, plugin = load_plugin(spec)
    ctx = PluginContext(model=tiny_dir, dtype="fp32", params={"context_tokens": "192", "sparsity": "0.5"})
    metrics = run_plugin(name, plugin, ctx).aggregates["metrics"]
    variants = plugin.variants
    assert len(variants) == 12 and {"oracle-token", "future-block", "token-split", "token-ada-all"} <= set(
        variants
    )
    keys = {f"delta_ppl_{part}pct_{v}" for v in variants for part in ("", "after_prompt_")}
    assert set(metrics) == {"ppl_ref", *keys} and metrics["ppl_ref"] > 1
    assert all(metrics[f"delta_ppl_pct_{v}"] != 0.0 for v in variants)  # every variant changed the attention
    assert len({round(metrics[f"delta_ppl_pct_{v}"], 9) for v in variants}) == len(variants)  # differently
    deferred = PluginContext(
        model=tiny_dir,
        dtype="fp32",
        params={"context_tokens": "192", "variants": "token-window", "defer_prompt": "1"},
    )
    late = run_plugin(name, plugin, deferred).aggregates["metrics"]
    # evicting from the prompt's end on leaves the prompt's positions exact: all of the whole text's change
    # (191 scored positions) is in the 95 after the prompt
    whole, after = (late[f"delta_ppl_{p}pct_token-window"] / 100 for p in ("", "after_prompt_"))
    assert after != 0 and math.isclose(191 * math.log1p(whole), 95 * math.log1p(after), rel_tol=1e-4)
    bad = PluginContext(model=tiny_dir, dtype="fp32", params={"variants": "block-random"})
    with pytest.raises(PluginError, match="variants must be among"):
        run_plugin(name, plugin, bad)
    # a summary slot for the dropped tokens changes what the kept ones give (and only names it knows)
    summary = PluginContext(
        model=tiny_dir,
        dtype="fp32",
        params={"context_tokens": "192", "variants": "token-window", "defer_prompt": "1", "summary": "mean"},
    )
    with_slot = run_plugin(name, plugin, summary).aggregates["metrics"]["delta_ppl_pct_token-window"]
    assert with_slot != late["delta_ppl_pct_token-window"]
    with pytest.raises(PluginError, match="summary must be"):
        run_plugin(name, plugin, PluginContext(model=tiny_dir, params={"summary": "median"}))
    # per-layer budgets: one run per spec, named after it; a layer that keeps everything changes the result
    specs = {"context_tokens": "192", "variants": "token-window", "defer_prompt": "1"}
    layered = PluginContext(
        model=tiny_dir, dtype="fp32", params={**specs, "layer_budget": "uniform;dense:1;only:0"}
    )
    by_layer = run_plugin(name, plugin, layered).aggregates["metrics"]
    assert by_layer["delta_ppl_pct_token-window"] == late["delta_ppl_pct_token-window"]
    assert len({by_layer[f"delta_ppl_pct_token-window{s}"] for s in ("", "@dense:1", "@only:0")}) == 3
    for spec, match in (("pyramid", "layer_budget must be"), ("weights:1/0", "positive weights")):
        with pytest.raises(PluginError, match=match):
            run_plugin(name, plugin, PluginContext(model=tiny_dir, params={**specs, "layer_budget": spec}))
    # weights from one text's per-layer probes, applied to another: probes reported, texts named
    calibrated = {**specs, "text": "0+1", "layer_budget": "uniform;sensitivity:1"}
    cal = run_plugin(name, plugin, PluginContext(model=tiny_dir, dtype="fp32", params=calibrated))
    cal = cal.aggregates["metrics"]
    layers = plugin.num_layers
    assert {f"only_layer_{i}_delta_ppl_pct_token-window_t1" for i in range(layers)} <= set(cal)
    assert cal["delta_ppl_pct_token-window_t0"] == late["delta_ppl_pct_token-window"]
    assert "delta_ppl_pct_token-window@sensitivity:1_t0" in cal  # (random weights: no layer hurts, uniform)
    plugin._probes["v", 7] = [3.0, 1.0] + [-0.5] * (layers - 2)  # probes: shares 0.75, 0.25, floored
    weights = [float(w) for w in plugin._resolve("v", "sensitivity:7").removeprefix("weights:").split("/")]
    assert weights == pytest.approx([0.75**0.5, 0.25**0.5] + [0.005**0.5] * (layers - 2), rel=1e-5)
    assert cal["ppl_ref_t0"] != cal["ppl_ref_t1"]
    budgets = sys.modules[type(plugin).__module__]._layer_budgets  # the same total, shared as asked
    for spec in ("uniform", "pyramid:3", "dense:2", "weights:" + "/".join(["9"] * 3 + ["1"] * 27)):
        b = budgets(spec, 307, 1024, 30)
        assert 307 * 30 - 30 < sum(b) <= 307 * 30 and max(b) <= 1024
    assert budgets("dense:2", 307, 1024, 30)[:3] == [1024, 1024, 255]
    assert budgets("pyramid:3", 307, 1024, 30)[0] == pytest.approx(
        3 * budgets("pyramid:3", 307, 1024, 30)[-1], abs=3
    )
    assert budgets("only:4", 307, 1024, 30) == [1024] * 4 + [307] + [1024] * 25
    # calibrating on text 1 first leaves text 0's clairvoyant variant reading text 0's own recorded attention
    future = {**specs, "variants": "future-block"}
    alone = run_plugin(name, plugin, PluginContext(model=tiny_dir, dtype="fp32", params=future))
    after_probe = {**future, "layer_budget": "sensitivity:1;uniform"}
    probed = run_plugin(name, plugin, PluginContext(model=tiny_dir, dtype="fp32", params=after_probe))
    key = "delta_ppl_pct_future-block"
    assert probed.aggregates["metrics"][key] == alone.aggregates["metrics"][key]
    oracle = {**specs, "variants": "oracle-block", "layer_budget": "dense:1"}
    with pytest.raises(PluginError, match="not to the oracles"):
        run_plugin(name, plugin, PluginContext(model=tiny_dir, params=oracle))


def test_quant_gemm_plugin_times_every_path_it_names(tiny_dir):
    name, plugin = load_plugin(f"{EXAMPLES / 'quant_gemm.py'}:QuantGemm")
    ctx = PluginContext(model=tiny_dir, params={"rows": "1,5", "layers": "o", "repeats": "1"})
    metrics = run_plugin(name, plugin, ctx).aggregates["metrics"]
    paths = ("fallback", "dequant_fp32", "fp32") + (("gemm",) if plugin.has_gemm else ())
    expected = {f"{fmt}_o_{rows}_ms_{p}" for fmt in ("int8", "int4") for rows in (1, 5) for p in paths}
    assert expected <= set(metrics) and all(metrics[key] > 0 for key in expected)
    if plugin.has_gemm:  # int8 in two activation planes: float-accurate; int4: one int8 plane per 32 values
        assert metrics["int8_o_5_rel_err_gemm"] < 1e-4 and metrics["int4_o_5_rel_err_gemm"] < 0.02
    with pytest.raises(ValueError, match="formats from"):
        plugin.init(PluginContext(model=tiny_dir, params={"formats": "int3"}))


def test_int4_prefill_split_plugin_times_both_paths(tiny_dir):
    """Both int4 paths and the uncompressed cache are timed side by side; the one-call engine really takes
    the one-call path (its steps see no split device), the torch-ops engine merges without the kernel, and the
    globals are restored after each of them."""
    from mcp2026.models import attention

    name, plugin = load_plugin(f"{EXAMPLES / 'int4_prefill_split.py'}:Int4PrefillSplit")
    ctx = PluginContext(model=tiny_dir, dtype="fp32", params={"contexts": "40,72", "rounds": "1"})
    seen, one_calls, merges = [], [], []
    split, prefill = attention._split_staged_attention, attention._prefill_attention
    merge_kernels = attention._merge_kernels

    def spy_split(*args, **kwargs):
        seen.append(attention.SPLIT_STAGED_DEVICES)
        merges.append(attention._merge_kernels is merge_kernels)  # False: the torch-ops engine's steps
        return split(*args, **kwargs)

    def spy_prefill(q, k, v, mask, offset=0):
        one_calls.append(offset is None)  # only a staged chunk read in one call passes no causal offset
        return prefill(q, k, v, mask, offset)

    from mcp2026.kv.paged_cache import PagedKVCache

    seal, torch_seals = PagedKVCache._seal_in_one_call, []

    def spy_seal(self, *args):
        torch_seals.append(self._int4_seal_groups is None)  # True: the torch-ops engine's cache
        return seal(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PagedKVCache, "_seal_in_one_call", spy_seal)
        mp.setattr(attention, "_split_staged_attention", spy_split)
        mp.setattr(attention, "_prefill_attention", spy_prefill)
        metrics = run_plugin(name, plugin, ctx).aggregates["metrics"]
    assert any(one_calls)
    assert set(metrics) == {
        f"{m}_{n}_r0"
        for m in ("fp_tok_s", "apart_vs_fp", "one_call_vs_fp", "apart_torch_vs_fp")
        for n in (40, 72)
    }
    assert all(v > 0 for v in metrics.values())
    assert seen and all(s == ("cpu",) for s in seen) and attention.SPLIT_STAGED_DEVICES == ("cpu",)
    assert set(merges) == {True, False} and attention._merge_kernels is merge_kernels
    assert set(torch_seals) == {True, False}
    profiled = PluginContext(
        model=tiny_dir, dtype="fp32", params={"contexts": "40", "rounds": "1", "profile": "1"}
    )
    metrics = run_plugin(name, plugin, profiled).aggregates["metrics"]
    for tag in ("fp", "apart", "torch", "one_call"):
        assert metrics[f"profile_{tag}_attention_s"] > 0 and metrics[f"profile_{tag}_writes_s"] > 0
    # the own-block merge is timed where chunks are read apart, and only there
    assert metrics["profile_apart_own_block_s"] > 0 and metrics["profile_torch_own_block_s"] > 0
    assert metrics["profile_fp_own_block_s"] == metrics["profile_one_call_own_block_s"] == 0
    with pytest.raises(PluginError, match="contexts must be in"):
        run_plugin(name, plugin, PluginContext(model=tiny_dir, params={"contexts": "100000"}))
