"""Quality metrics: perplexity and KLD on synthetic logits (llama.cpp-style windows), the role mixture."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from mcp2026.bench.quality import QualityResult, evaluate, kld_of, reference_logprobs
from mcp2026.bench.quant_quality import (
    BF16_PLAN,
    _fixed_plans,
    _gptq_plans,
    as_decode_steps,
    bf16_row,
    role_mixture_plan,
    use_more_bits,
    wide_output_plan,
)
from mcp2026.quant.perplexity import nll_of, perplexity, windows_from_tokens
from mcp2026.quant.plan import LayerQuantSpec

pytestmark = pytest.mark.usefixtures("one_thread")


class FixedLogits(nn.Module):
    """A 'model' whose logits are a function of the token only (or constant)."""

    def __init__(self, vocab: int, table: torch.Tensor | None = None) -> None:
        super().__init__()
        self.table = nn.Parameter(
            table if table is not None else torch.zeros(vocab, vocab), requires_grad=False
        )

    def forward(self, ids, positions):
        return self.table[ids]  # hidden = the logits row

    def compute_logits(self, hidden):
        return hidden.float()


def test_uniform_logits_give_perplexity_equal_to_vocab_size():
    vocab = 50
    windows = windows_from_tokens(torch.randint(vocab, (1024,)).tolist(), 256)
    result = evaluate(FixedLogits(vocab), windows)
    assert result.ppl == pytest.approx(vocab, rel=1e-6)
    assert result.num_tokens == 4 * (256 // 2 - 1)  # 4 windows: second halves, minus the last position
    assert perplexity(FixedLogits(vocab), windows) == result.ppl  # the DQG's check scores the same tokens


def test_identical_model_has_zero_kld_and_full_agreement():
    vocab = 40
    model = FixedLogits(vocab, torch.randn(vocab, vocab) * 3)
    windows = windows_from_tokens(torch.randint(vocab, (512,)).tolist(), 128)
    for reference in (model, reference_logprobs(model, windows)):
        result = evaluate(model, windows, reference)
        assert result.kld == 0.0 and result.top1_agreement == 1.0
        assert result.delta_ppl == 0.0 and result.reference_ppl == pytest.approx(result.ppl)


def test_kld_and_nll_match_hand_computation():
    p = torch.tensor([[0.5, 0.25, 0.25]])
    q = torch.tensor([[0.25, 0.5, 0.25]])
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert kld_of(p.log(), q.log()).item() == pytest.approx(expected, rel=1e-6)
    assert nll_of(q.log(), torch.tensor([1])).item() == pytest.approx(math.log(2))


def test_different_model_has_positive_kld_and_ppl_change():
    vocab = 40
    table = torch.randn(vocab, vocab) * 3
    windows = windows_from_tokens(torch.randint(vocab, (512,)).tolist(), 128)
    result = evaluate(
        FixedLogits(vocab, table + 0.3 * torch.randn(vocab, vocab)), windows, FixedLogits(vocab, table)
    )
    assert result.kld > 0 and result.kld_p99 >= result.kld and 0 <= result.top1_agreement < 1
    assert result.delta_ppl == pytest.approx(result.ppl / result.reference_ppl - 1, rel=1e-9)
    assert result.delta_ppl_stderr > 0


def test_use_more_bits_is_llama_cpp_rule():
    # llama.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, integer division
    more = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [i for i in range(30) if use_more_bits(i, 30)] == more
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]


def test_bf16_row_runs_our_model_in_bf16_against_the_fp32_reference(tiny_llama_dir):
    from mcp2026.loading.loader import load_model

    model = load_model(tiny_llama_dir, dtype=torch.float32).model
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(320, (64,), generator=gen) for _ in range(3)]
    row = bf16_row(tiny_llama_dir, windows, reference_logprobs(model, windows))
    assert row["plan"] == BF16_PLAN and row["family"] == "dtype" and row["num_tokens"] == 3 * 31
    assert 0 < row["kld"] < 0.05  # bf16 rounding: not the fp32 model, not far from it


def test_role_mixture_plan(tiny_llama_dir):
    from mcp2026.loading.loader import load_model

    model = load_model(tiny_llama_dir).model  # 2 layers: only layer 1 is "first/last eighth"
    plan = role_mixture_plan(model, LayerQuantSpec("int4", 64, symmetric=True))
    assert plan.spec_for("layers.1.attn.qkv_proj").format == "int8"
    assert plan.spec_for("layers.1.mlp.down_proj").format == "int8"
    assert plan.spec_for("layers.1.mlp.gate_up_proj") == LayerQuantSpec("int4", 64, symmetric=True)
    assert plan.spec_for("layers.0.attn.qkv_proj").format == "int4"
    assert 4.5 < plan.avg_bits_per_weight(model) < 8


def test_wide_output_plan_keeps_the_lm_head_in_int8_as_q8_0_does(tiny_llama_dir):
    from mcp2026.loading.loader import load_model

    model = load_model(tiny_llama_dir).model
    body = LayerQuantSpec("int4", 32, symmetric=True)
    plan = wide_output_plan(model, body)
    assert plan.spec_for("lm_head") == LayerQuantSpec("int8", 32)  # groups of 32: Q8_0's form
    assert plan.spec_for("layers.0.mlp.down_proj") == body


def test_gptq_rows_pair_each_int4_layout_with_its_round_to_nearest_row(tiny_llama_dir):
    from mcp2026.loading.loader import load_model

    model = load_model(tiny_llama_dir).model
    fixed = _fixed_plans(model)
    twins = _gptq_plans(fixed)
    assert "GPTQ int4 sym g32, lm_head int8" in twins and "GPTQ act-order int4 asym g64" in twins
    assert "learned int4 sym g32" in twins and "learned int4 asym g64, lm_head int8" in twins
    assert "GPTQ int4 asym g32 8-bit scales" in twins  # learned scales are fp16 grids: no learned twin
    assert "learned int4 asym g32 8-bit scales" not in twins and "int4 asym g32 8-bit scales" in fixed
    for name, (plan, family) in twins.items():
        method = "learned" if family == "learned" else "gptq"
        rtn = next(p for n, p in fixed.items() if n.split(" (")[0] == name.removeprefix(family + " "))
        assert plan.avg_bits_per_weight(model) == rtn.avg_bits_per_weight(model)
        specs, rtn_specs = plan.layer_specs(model), rtn.layer_specs(model)
        for layer, spec in specs.items():
            same = dataclasses.replace(spec, method="rtn") == rtn_specs[layer]
            assert same and (spec.method == method) == (spec.format == "int4"), (name, layer)


def test_as_decode_steps_feeds_quantized_linears_decode_sized_chunks(monkeypatch):
    from mcp2026.quant import cpu_routing as routing
    from mcp2026.quant import linear as qlinear

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32))
    model[0] = qlinear.Int4Linear.from_linear(model[0], LayerQuantSpec("int4"), torch.bfloat16)
    model[2] = qlinear.Int8Linear.from_linear(model[2], LayerQuantSpec("int8"), torch.bfloat16)
    x = torch.randn(21, 64)
    with torch.inference_mode():
        whole = model(x)
        rows_seen = []
        forward = qlinear.Int4Linear.forward
        monkeypatch.setattr(
            qlinear.Int4Linear, "forward", lambda self, t: rows_seen.append(len(t)) or forward(self, t)
        )
        assert as_decode_steps(model) == 2
        chunked = model(x)
    assert max(rows_seen) <= routing.GEMV_MAX_ROWS and sum(rows_seen) == 21
    assert chunked.shape == whole.shape
    assert ((chunked - whole).norm() / whole.norm()).item() < 0.02  # int8 vs bf16 activations


def test_quality_result_dict_has_after_prompt_fields_only_with_a_prompt():
    windowed = QualityResult(2.0, math.log(2.0), 10)
    assert "ppl_after_prompt" not in windowed.to_dict()
    lockstep = QualityResult(2.0, math.log(2.0), 10, num_tokens_after_prompt=4, ppl_after_prompt=2.5)
    assert lockstep.to_dict()["ppl_after_prompt"] == 2.5
