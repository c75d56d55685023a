"""The default path on the real default model: its GGUF runs as stored (Q4_1 linears, Q8_0 table), the weights held
are about the file's size, and its perplexity on held-out text stays within the activations' int8 rounding of
the float (dequantized) model's."""

from __future__ import annotations

import pytest
import torch

from mcp2026 import Pipeline, SamplingParams
from mcp2026.bench.quality import evaluate
from mcp2026.kernels import ops as kernel_ops
from mcp2026.loading.loader import load_model, weight_bytes
from mcp2026.quant.block_linear import BlockEmbedding, BlockLinear
from mcp2026.quant.perplexity import evaluation_windows

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(kernel_ops.cpu.load() is None, reason="stored blocks run on the compiled CPU kernels"),
]


@pytest.fixture(scope="module")
def native() -> Pipeline:
    return Pipeline()


def test_default_pipeline_runs_the_file_as_stored(native, default_model_path):
    assert native.native_blocker is None and native.loaded.weights == "native"
    model = native.loaded.model
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 4 * native.loaded.config.num_layers + 1  # the tied lm_head is the table
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.lm_head is model.embed_tokens.table
    assert {f for m in linears for f in m.formats} == {"Q4_1", "Q8_0"}
    # the file's 4.5 / 8.5 bits per weight held as 6 / 10 (fp32 scale and offset per 32)
    assert weight_bytes(model) < 1.25 * default_model_path.stat().st_size
    out = native.infer(["The three primary colors are"], SamplingParams(max_tokens=12), profile=True)
    assert out.outputs[0].text.strip() and out.memory["weights"] == weight_bytes(model)


def test_float_dtype_asks_for_the_float_path():
    pipe = Pipeline(dtype="fp32")
    assert pipe.loaded.weights == "float" and "dtype=fp32" in pipe.native_blocker


def test_perplexity_within_activation_rounding_of_the_float_model(native):
    reference = load_model(None, torch.float32).model
    windows = evaluation_windows(native.tokenizer, 2, n_ctx=256)
    result = evaluate(native.loaded.model, windows, reference)
    # bounds well above what the rounding costs on this model (docs/benchmarks.md, "Stored formats")
    assert result.delta_ppl < 0.02 and result.kld < 0.01 and result.top1_agreement > 0.9, result
