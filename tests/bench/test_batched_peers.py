"""The batched-decode peers: llama.cpp's batch API against its own one-at-a-time decode (where
llama-cpp-python is installed), and the vLLM subprocess plumbing with a stand-in script (vLLM is never in CI)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest

from mcp2026.bench import batched_peers, offline
from mcp2026.bench.peers import PeerUnavailable
from mcp2026.bench.workloads import BenchRequest


def request(k: int, prompt: list[int], output_len: int) -> BenchRequest:
    return BenchRequest(f"r{k}", prompt, output_len)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")
def test_llama_cpp_batched_gives_each_sequence_its_own_greedy_tokens(default_model_path):
    from mcp2026.bench.peers import llama_cpp_decode_latency, load_llama_cpp

    prompts = [
        [1, 504, 3458, 282, 4649, 314],
        [1, 378, 253, 2072, 30, 1812, 282, 253, 1114, 314, 29, 198],
        [9, 17],
    ]
    requests = [request(k, p, n) for k, (p, n) in enumerate(zip(prompts, (5, 7, 3), strict=True))]
    # n_batch 8: the second prompt's prefill spans two batches, with the first and third prompts beside it
    result = batched_peers.llama_cpp_batched(requests, default_model_path, n_threads=2, n_batch=8)
    assert [x["num_output_tokens"] for x in result.records] == [5, 7, 3]
    assert result.num_output_tokens == 15 and result.decode_tokens == 15 - 3  # first tokens come from prefill
    alone = load_llama_cpp(default_model_path, n_threads=2)
    for r, tokens in zip(requests, result.details["token_ids"], strict=True):
        assert tokens == llama_cpp_decode_latency(alone, r.prompt_token_ids, r.output_len).token_ids[0]


def fake_venv(tmp_path, script: str, monkeypatch) -> str:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    fake = tmp_path / "fake_vllm.py"
    fake.write_text(textwrap.dedent(script))
    monkeypatch.setattr(batched_peers, "VLLM_SCRIPT", fake)
    return str(venv)


def test_vllm_runs_in_its_venv_and_decode_is_full_minus_first_token(tmp_path, monkeypatch):
    script = """
        import json, os, sys
        spec = json.load(open(sys.argv[1]))
        print("INFO a log line of vLLM")
        print(json.dumps({
            "first_seconds": [1.0, 3.0, 2.0], "full_seconds": [4.0, 9.0, 6.0],
            "num_output_tokens": [r["output_len"] for r in spec["requests"]],
            "version": spec["model"] + "|" + os.environ["VLLM_CPU_OMP_THREADS_BIND"] + "|" + str(spec["rounds"]),
        }))
    """
    venv = fake_venv(tmp_path, script, monkeypatch)
    requests = [request(0, [1, 2, 3], 4), request(1, [4, 5], 6)]
    result = batched_peers.vllm_batched(requests, venv, tmp_path / "hf", n_threads=2, rounds=3)
    assert result.details["version"] == f"{tmp_path / 'hf'}|0-1|3"
    assert result.seconds == 6.0 and result.details["first_token_seconds"] == 2.0  # medians over rounds
    assert result.decode_seconds == 4.0 and result.decode_tokens == 3 + 5
    agg = offline.throughputs(
        result.seconds, result.num_output_tokens, 5, result.decode_tokens, result.decode_seconds
    )
    assert agg["decode_tok_per_s"] == 2.0 and agg["output_tok_per_s"] == 10 / 6.0
    assert [x["num_output_tokens"] for x in result.records] == [4, 6]


def test_vllm_that_fails_or_is_missing_is_a_skipped_peer_with_the_reason(tmp_path, monkeypatch):
    venv = fake_venv(
        tmp_path, "import sys\nsys.exit('ModuleNotFoundError: No module named vllm')\n", monkeypatch
    )
    with pytest.raises(PeerUnavailable, match="exited with 1.*No module named vllm"):
        batched_peers.vllm_batched([request(0, [1, 2], 2)], venv, tmp_path / "hf")
    with pytest.raises(PeerUnavailable, match="does not exist"):
        batched_peers.vllm_batched([request(0, [1, 2], 2)], tmp_path / "nowhere", tmp_path / "hf")
