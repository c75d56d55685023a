"""Latency benchmark end to end on a tiny random model (no tokenizer: random prompts), with the HF peer."""

from __future__ import annotations

import torch

from mcp2026.bench.latency import LatencyConfig, run_latency

from conftest import save_tiny_hf


def test_latency_interleaves_and_reports_ratios(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads
    try:
        _check_latency_run(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _check_latency_run(tmp_path):
    model = str(save_tiny_hf(tmp_path / "tiny", max_position_embeddings=128))
    config = LatencyConfig(
        model=model, dtypes=("fp32",), new_tokens=5, prefill_tokens=12, repeats=1, warmup=1, weights=("int8",)
    )
    run = run_latency(config)
    order = [(r["engine"], r["dtype"], r["round"]) for r in run.records if r["metric"] == "decode"]
    per_round = [("mcp2026", "fp32"), ("hf", "fp32"), ("mcp2026", "int8 weights")]
    assert order == [(*c, r) for r in (0, 1) for c in per_round]
    # tokens after the first: a step that kept drafts counts each of its tokens
    assert all(r["tokens"] == 4 and 1 <= r["steps"] <= 4 for r in run.records if r["metric"] == "decode")
    assert all(r["tokens"] == 12 for r in run.records if r["metric"] == "prefill")
    medians = run.aggregates["median_tok_per_s"]
    assert medians["mcp2026/fp32"]["decode"] > 0 and medians["hf/fp32"]["prefill"] > 0
    assert "mcp2026/fp32 vs hf/fp32" in run.aggregates["ratios"]
    assert "mcp2026/int8 weights vs hf/fp32" in run.aggregates["ratios"]
    assert "--weights int8" in run.command
    assert run.aggregates["greedy_agreement"]["fp32"] == 5  # same weights, same ids: same greedy tokens
    assert run.tables[0].rows[0][0] == "mcp2026"


def test_weights_accept_a_dqg_budget_and_reject_nonsense():
    import pytest

    from mcp2026.bench.offline import OfflineConfig
    from mcp2026.bench.weights import quant_config

    config = LatencyConfig(weights=("int4", "dqg:5"))
    assert "--weights int4,dqg:5" in config.command()
    assert "--weights bf16,dqg:4.5" in OfflineConfig(weights=("bf16", "dqg:4.5")).command()
    assert quant_config("dqg:4.75").enable_dqg and quant_config("dqg:4.75").bits_budget == 4.75
    assert quant_config("int8").target_precision == "int8"
    for bad in ("dqg", "dqg:-1", "dqg:five", "int3", "dqg:1", "dqg:100"):  # QuantConfig allows 2..32 bits
        with pytest.raises(ValueError, match=r"dqg:BITS|bits_budget must be in \[2, 32\]"):
            LatencyConfig(weights=(bad,))


def test_decode_tokens_count_every_token_a_step_kept():
    from mcp2026.bench.peers import GenerationTiming

    # 4 stamps: the prompt's step (1 token), then steps that kept 0, 2 and 1 drafts
    drafted = GenerationTiming(0.0, 1.0, [0.1, 0.2, 0.5, 0.9], [list(range(1 + 1 + 3 + 2))])
    assert drafted.decode_tokens == 6 and drafted.num_steps == 4
    assert GenerationTiming(0.0, 1.0, [0.1, 0.2, 0.3]).decode_tokens == 2  # no ids: one token per stamp


def test_no_speculative_decodes_one_token_a_step(tmp_path):
    model = str(save_tiny_hf(tmp_path / "tiny", max_position_embeddings=128))
    config = LatencyConfig(
        model=model, dtypes=("fp32",), new_tokens=6, prefill_tokens=8, repeats=1, warmup=0, peer=False,
        speculative=False,
    )  # fmt: skip
    run = run_latency(config)
    assert "--no-speculative" in run.command
    assert all(r["tokens"] == r["steps"] == 5 for r in run.records if r["metric"] == "decode")


def test_a_long_context_run_decodes_after_that_many_tokens_and_is_its_own_kind(tmp_path):
    import pytest

    model = str(save_tiny_hf(tmp_path / "tiny", max_position_embeddings=256))
    config = LatencyConfig(
        model=model, dtypes=("fp32",), new_tokens=4, prefill_tokens=8, repeats=1, warmup=0, peer=False,
        context_tokens=150,
    )  # fmt: skip
    run = run_latency(config)
    assert run.kind == "latency-context" and "--context-tokens 150" in run.command
    assert run.aggregates["decode_prompt_len"] == 150
    assert "after a 150-token ShareGPT context" in run.tables[0].title
    decode = [r for r in run.records if r["metric"] == "decode"]
    assert decode and all(r["tokens"] == 3 for r in decode)
    with pytest.raises(ValueError, match="context_tokens >= 0"):
        LatencyConfig(context_tokens=-1)
