"""GGUF export: the written blocks hold the weights our quantized linears run (int8 -> Q8_0, int4 sym -> Q4_0,
int4 asym -> Q4_1), stored GGUF blocks come back byte for byte, our loader and llama.cpp read the file back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcp2026.export.gguf_export import export_gguf
from mcp2026.export.report import PACKED, SOURCE
from mcp2026.loading.gguf_file import GGUFFile
from mcp2026.loading.loader import load_model
from mcp2026.quant import dqg, recipe
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan

from export_models import COMPUTE_DTYPES, compiled, dequantized_copy, logits, with_weights
from gguf_files import CHAT_TEMPLATE, write_tiny_gguf

PLANS = {
    "int8": QuantPlan.uniform("int8"),
    "int4 sym g32": QuantPlan.uniform("int4", group_size=32, symmetric=True),
    "int4 asym g32": QuantPlan.uniform("int4", group_size=32),
    "mixed": QuantPlan(
        {
            "layers.0.attn.qkv_proj": LayerQuantSpec("int8"),
            "layers.0.mlp.gate_up_proj": LayerQuantSpec("int4", 64, symmetric=True),
            "layers.1.mlp.down_proj": LayerQuantSpec("int4", 128, clip_ratio="mse"),
            "layers.1.attn.o_proj": LayerQuantSpec("int4", 32, scale_bits=8),  # decoded to fp16 grids
            "lm_head": LayerQuantSpec("fp32"),
            "_default": LayerQuantSpec("int4", 32),
        }
    ),  # fmt: skip
}
EXACT = {"int8", "int4 sym g32"}  # no Q4_1 offsets: every scale is fp16-exact
# Q4_1's offset m = zero - 8 * scale is rounded to fp16: at most half an fp16 ulp of |m| (< 2^-11 |m|)
Q4_1_RTOL = 2.0**-11


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_exported_blocks_hold_the_weights_we_run(tmp_path, plan_name):
    loaded = compiled(tmp_path, PLANS[plan_name])
    ours = dequantized_copy(loaded.model)
    report = export_gguf(loaded, tmp_path / "model.gguf")
    types = {r.type_name for r in report.tensors if r.origin == PACKED}
    assert types == {"int8": {"Q8_0"}, "int4 sym g32": {"Q4_0"}, "int4 asym g32": {"Q4_1"}}.get(
        plan_name, {"Q8_0", "Q4_0", "Q4_1"}
    )
    back = load_model(tmp_path / "model.gguf")  # floats: each block dequantized as gguf.quants does
    again = dequantized_copy(back.model)
    assert again.keys() == ours.keys()
    for name, w in ours.items():
        if plan_name in EXACT:
            assert torch.equal(again[name], w), name
        else:
            torch.testing.assert_close(again[name], w, rtol=0, atol=Q4_1_RTOL * float(w.abs().max()))
    ids = torch.randint(320, (24,))
    expected = logits(with_weights(loaded.model, ours), ids)
    # equal weights; the two models differ only in how the float matmuls are laid out (fp32 rounding)
    atol = 1e-5 if plan_name in EXACT else 1e-3
    torch.testing.assert_close(logits(back.model, ids), expected, rtol=0, atol=atol)
    assert (report.max_relative_error == 0.0) == (plan_name in EXACT)


def test_our_native_load_of_the_export_runs_the_same_model(tmp_path, kernels):
    loaded = compiled(tmp_path, PLANS["mixed"])
    ids = torch.randint(320, (24,))
    expected = logits(loaded.model, ids)
    export_gguf(loaded, tmp_path / "model.gguf")
    native = load_model(tmp_path / "model.gguf", native=True)
    assert native.weights == "native"
    # both run int8-quantized activations (per 32 values), each kernel its own way: within 2% of the logit range
    torch.testing.assert_close(
        logits(native.model, ids), expected, rtol=0, atol=0.02 * float(expected.abs().max())
    )


def test_stored_gguf_blocks_are_written_back_byte_for_byte(tmp_path, kernels):
    source = write_tiny_gguf(tmp_path / "src.gguf", "Q4_K", tie=False, v_type="Q6_K")
    loaded = load_model(source, native=True)
    ids = torch.randint(320, (24,))
    expected = logits(loaded.model, ids)
    report = export_gguf(loaded, tmp_path / "out.gguf")
    assert all(
        r.origin == SOURCE for r in report.tensors if r.name.endswith(".weight") and r.type_name != "F32"
    )
    src, out = GGUFFile.open(source), GGUFFile.open(tmp_path / "out.gguf")
    written = {t.name: t for t in out.tensors}
    for t in src.tensors:
        assert written[t.name].tensor_type == t.tensor_type, t.name
        assert np.array_equal(out.raw(written[t.name]), src.raw(t)), t.name
    assert torch.equal(logits(load_model(tmp_path / "out.gguf", native=True).model, ids), expected)


def test_a_plan_on_a_gguf_keeps_the_untouched_tensors_as_stored(tmp_path):
    source = write_tiny_gguf(tmp_path / "src.gguf", "Q8_0")  # tied: the token table is the output too
    loaded = load_model(source)
    plan = QuantPlan({"lm_head": LayerQuantSpec("int4", 32, symmetric=True)})
    recipe.apply(loaded.model, dqg.DQGResult("uniform", plan, {}), COMPUTE_DTYPES, progress=False)
    report = export_gguf(loaded, tmp_path / "out.gguf")
    kinds = {r.name: (r.type_name, r.origin) for r in report.tensors}
    assert kinds["output.weight"] == ("Q4_0", PACKED)  # the quantized output, no longer tied
    assert kinds["token_embd.weight"] == ("Q8_0", SOURCE)
    assert kinds["blk.0.attn_q.weight"] == ("Q8_0", SOURCE)  # q rows: query scale and permutation undone
    back = load_model(tmp_path / "out.gguf")
    assert not back.config.tie_word_embeddings


def test_tokenizer_and_chat_template_are_carried_over(tmp_path):
    loaded = compiled(tmp_path, PLANS["int8"])
    export_gguf(loaded, tmp_path / "model.gguf")
    meta = GGUFFile.open(tmp_path / "model.gguf", tensors=False).metadata
    assert meta["tokenizer.ggml.pre"] == "smollm" and meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    back = load_model(tmp_path / "model.gguf").tokenizer
    text = "Hello abc 2026, naïve  x\n\ty"
    assert back.encode(text) == loaded.tokenizer.encode(text)
    assert back.eos_token_ids[0] == loaded.tokenizer.eos_token_ids[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_llama_cpp_reads_the_export(tmp_path, arch):
    llama_cpp = pytest.importorskip("llama_cpp")
    loaded = compiled(tmp_path, PLANS["mixed"] if arch == "llama" else QuantPlan({}), arch)
    ids = torch.randint(320, (24,))
    expected = logits(with_weights(loaded.model, dequantized_copy(loaded.model)), ids)
    export_gguf(loaded, tmp_path / "model.gguf")
    llm = llama_cpp.Llama(str(tmp_path / "model.gguf"), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    try:
        llm.eval(ids.tolist())
        theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
        text = b"Hello abc 2026"
        assert llm.tokenize(text, add_bos=False) == loaded.tokenizer.encode(
            text.decode(), add_special_tokens=False
        )
    finally:
        llm.close()
    # llama.cpp's kernels against ours in fp32 on the same weights: its float and block dot products (measured
    # 1.6e-4 .. 2.9e-4 of the logit range, quantized or not); a wrong permutation, scale or offset is far beyond
    tolerance = 1e-3 * float(expected.abs().max())
    torch.testing.assert_close(theirs, expected, rtol=0, atol=tolerance)
