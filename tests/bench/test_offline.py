"""Offline benchmark end to end on a tiny random model: ours alone, with the HF peer, and via the CLI."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mcp2026.bench.offline import OfflineConfig, run_offline
from mcp2026.bench.report import read_run, write_run

from conftest import save_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_hf(tmp_path_factory.mktemp("tiny_bench"), max_position_embeddings=256))


def test_offline_ours_only(tiny_dir, tmp_path):
    config = OfflineConfig(
        model=tiny_dir, workload="random", num_prompts=4, input_len=16, output_len=8, peer=False, dtype="fp32"
    )
    run = run_offline(config)
    ours = [r for r in run.records if r["engine"] == "mcp2026"]
    assert len(ours) == 4 and all(r["num_output_tokens"] == 8 for r in ours)
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in ours)
    agg = run.aggregates["mcp2026"]
    assert agg["num_output_tokens"] == 32 and agg["output_tok_per_s"] > 0
    assert agg["total_tok_per_s"] > agg["output_tok_per_s"]
    assert "hf" not in run.aggregates and any("--no-peer" in n for n in run.notes)
    assert "--no-peer" in run.command and "--workload random" in run.command
    assert read_run(write_run(run, tmp_path)) == run


def test_offline_with_hf_peer_counts_own_tokens(tiny_dir):
    config = OfflineConfig(
        model=tiny_dir,
        workload="random",
        num_prompts=3,
        input_len=12,
        output_len=6,
        batch_size=2,
        dtype="fp32",
    )
    run = run_offline(config)
    hf = [r for r in run.records if r["engine"] == "hf"]
    assert [r["num_output_tokens"] for r in hf] == [6, 6, 6]
    assert run.aggregates["hf"]["num_generated_tokens"] == 3 * 6
    assert [b["size"] for b in run.aggregates["hf_batches"]] == [2, 1]
    assert run.aggregates["ratio"]["output_tok_per_s"] > 0
    # A B A: ours ran the requests before and after HF, the second pass without the first one's prefix hits.
    ours = [r for r in run.records if r["engine"] == "mcp2026"]
    by_pass = {
        k: sorted((r["request_id"], r["num_cached_tokens"]) for r in ours if r["pass"] == k) for k in (0, 1)
    }
    assert len(ours) == 6 and by_pass[0] == by_pass[1]
    agg = run.aggregates["mcp2026"]
    assert agg["num_output_tokens"] == 2 * 3 * 6 and len(agg["passes_output_tok_per_s"]) == 2
    low, high = sorted(agg["passes_output_tok_per_s"])
    assert low <= agg["output_tok_per_s"] <= high  # both passes' tokens over both passes' seconds


def test_offline_goes_on_without_a_peer_that_cannot_load(tiny_dir, monkeypatch):
    import mcp2026.bench.peers as peers

    def cannot(*args, **kwargs):
        raise ValueError("GGUF model with architecture zork is not supported yet")

    monkeypatch.setattr(peers, "load_hf_model", cannot)
    config = OfflineConfig(
        model=tiny_dir, workload="random", num_prompts=2, input_len=8, output_len=4, dtype="fp32"
    )
    run = run_offline(config)
    assert "hf" not in run.aggregates and len(run.records) == 2  # ours once: no peer to go around
    assert any(n.startswith("HF transformers peer skipped") and "zork" in n for n in run.notes)


def test_batched_decode_mode(tiny_dir):
    config = OfflineConfig(model=tiny_dir, batched_decode=3, input_len=8, output_len=6, dtype="fp32")
    run = run_offline(config)
    assert run.kind == "offline-batched-decode"
    assert run.aggregates["mcp2026"]["decode_tok_per_s"] > 0
    assert run.aggregates["hf"]["decode_tok_per_s"] > 0
    assert run.tables[0].columns[2] == "decode tok/s"


def test_cli_offline(tiny_dir, tmp_path):
    from mcp2026.bench.cli import bench_app

    args = ["offline", "--model", tiny_dir, "--workload", "random", "--num-prompts", "2", "--input-len", "8"]
    args += ["--output-len", "4", "--no-peer", "--no-progress", "--dtype", "fp32", "--out", str(tmp_path)]
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    assert "Offline throughput: 2 random requests" in result.output
    assert len(list(tmp_path.glob("*-offline.json"))) == 1
    bad = CliRunner().invoke(bench_app, ["offline", "--model", str(tmp_path / "missing"), "--no-progress"])
    assert bad.exit_code == 2


def test_quantized_weights_run_the_same_requests_beside_fp32(tiny_dir):
    config = OfflineConfig(
        model=tiny_dir, workload="random", num_prompts=2, input_len=8, output_len=4, batch_size=2,
        dtype="fp32", weights=("int8",),
    )  # fmt: skip
    run = run_offline(config)
    int8 = [r for r in run.records if r["engine"] == "mcp2026-int8"]
    assert [r["num_output_tokens"] for r in int8] == [4, 4, 4, 4]  # two passes, around the HF peer
    assert len([r for r in run.records if r["engine"] == "mcp2026"]) == 4
    agg = run.aggregates
    assert agg["ratio_int8"]["output_tok_per_s"] == pytest.approx(
        agg["mcp2026-int8"]["output_tok_per_s"] / agg["hf"]["output_tok_per_s"]
    )
    labels = [row[0] for row in run.tables[0].rows]
    assert labels == [
        "mcp2026 (continuous batching)", "mcp2026, int8 weights", "HF transformers (static batch 2)",
        "mcp2026 / HF", "mcp2026 int8 / HF",
    ]  # fmt: skip
    assert "--weights int8" in run.command
    (bits,) = agg["layer_bits"].values()  # per linear, for `bench report`'s bit-plan heatmap
    assert list(agg["layer_bits"]) == ["int8 weights"] and all(8 < b < 9 for b in bits.values())
    from mcp2026.bench.figures import latency_samples

    assert set(latency_samples(run, "off")) == {"off", "off int8 weights"}  # a CDF series per config
    with pytest.raises(ValueError, match="int8, int4"):
        OfflineConfig(weights=("int3",))


def test_batched_decode_puts_llama_cpp_and_vllm_beside_ours(tiny_dir, monkeypatch, tmp_path):
    from mcp2026.bench import batched_peers

    def peer(name, decode_seconds):
        def run(requests, *args, **kwargs):
            n = sum(r.output_len for r in requests)
            records = [{"engine": name, "request_id": r.request_id, "num_output_tokens": r.output_len}
                       for r in requests]  # fmt: skip
            return batched_peers.BatchedPeerResult(
                name, 2 * decode_seconds, decode_seconds, n - 3, n, records
            )

        return run

    monkeypatch.setattr(batched_peers, "llama_cpp_batched", peer("llama.cpp", 4.0))
    monkeypatch.setattr(batched_peers, "vllm_python", lambda venv: tmp_path)
    monkeypatch.setattr(batched_peers, "vllm_batched", peer("vllm", 1.0))
    folder = tmp_path / "hf"
    config = OfflineConfig(
        model=tiny_dir,
        batched_decode=3,
        input_len=8,
        output_len=6,
        dtype="fp32",
        vllm_venv="v",
        vllm_model=str(folder),
    )
    run = run_offline(config)
    agg = run.aggregates
    assert agg["llama.cpp"]["decode_tok_per_s"] == 15 / 4.0 and agg["vllm"]["decode_tok_per_s"] == 15 / 1.0
    assert agg["ratio_vs_vllm"]["decode_tok_per_s"] == pytest.approx(agg["mcp2026"]["decode_tok_per_s"] / 15)
    assert len([r for r in run.records if r["engine"] == "mcp2026"]) == 6  # A B A around the peers
    labels = [row[0] for row in run.tables[0].rows]
    assert labels[-2:] == ["mcp2026 / llama.cpp", "mcp2026 / vLLM CPU"]
    assert "llama.cpp (batch API, same GGUF)" in labels and "--vllm-venv VENV" in run.command
    with pytest.raises(ValueError, match="batched-decode mode only"):
        OfflineConfig(vllm_venv="v")
