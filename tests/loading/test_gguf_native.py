"""A GGUF's block-quantized matrices kept as stored: exact values per format, the model's logits against the
dequantized (float) load of the same file, and the engine's greedy output on both paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from mcp2026.errors import ModelLoadError
from mcp2026.kernels import ops as kernel_ops
from mcp2026.loading.gguf_blocks import BLOCK_FORMATS, read_blocks
from mcp2026.loading.gguf_file import GGUFFile
from mcp2026.loading.loader import load_model
from mcp2026.quant import block_linear
from mcp2026.quant.block_linear import BlockEmbedding, BlockLinear

from gguf_files import VOCAB, random_blocks, write_tiny_gguf

needs_kernels = pytest.mark.skipif(
    kernel_ops.cpu.load() is None, reason="stored blocks run on the compiled CPU kernels"
)
FORMATS = sorted(BLOCK_FORMATS)


@pytest.mark.parametrize("type_name", FORMATS)
def test_blocks_equal_the_gguf_package_dequantization(type_name):
    raw = random_blocks(np.random.default_rng(1), type_name, 16, 512)
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(16, 512)
    blocks = read_blocks(raw, type_name)
    assert np.array_equal(blocks.dequantize().numpy(), expected)
    # the K-quants' (and IQ4_XS's) scales as stored, factor x integer: the same floats per group
    assert (blocks.super_blocks is not None) == BLOCK_FORMATS[type_name].super_blocks
    if blocks.super_blocks is not None:
        scale, offset = blocks.super_blocks.expand()
        assert torch.equal(scale, blocks.scale) and torch.equal(offset, blocks.offset)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)))
    return model.compute_logits(hidden)


@needs_kernels
@pytest.mark.parametrize("type_name", FORMATS)
def test_native_load_matches_the_dequantized_model(tmp_path, type_name):
    path = write_tiny_gguf(tmp_path / f"tiny-{type_name}.gguf", type_name, tie=type_name != "Q6_K")
    native = load_model(path, torch.float32, native=True)
    floats = load_model(path, torch.float32)
    assert (native.weights, floats.weights) == ("native", "float")
    model, reference = native.model, floats.model
    assert isinstance(model.embed_tokens, BlockEmbedding) and isinstance(model.lm_head, BlockLinear)
    assert (model.lm_head is model.embed_tokens.table) == native.config.tie_word_embeddings
    supers = BLOCK_FORMATS[type_name].super_blocks
    for name, module in model.named_modules():
        if isinstance(module, BlockLinear) and name != "embed_tokens.table":
            assert torch.equal(module.dequantize(), reference.get_submodule(name).weight), name
            assert (module.scales_offsets.dtype == torch.int8) == supers, name  # held per super-block
    assert torch.equal(model.embed_tokens.table.dequantize(), reference.embed_tokens.weight)
    ids = torch.tensor([5, 77, 3, 250, 19, 42, 300, 8])
    got, expected = _logits(model, ids), _logits(reference, ids)
    # the only difference: activations rounded to int8 per 32 values before each of the 5 matmuls a token meets
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 0.03, f"{type_name}: relative logit error {error:.4f}"
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.875


@needs_kernels
def test_mixed_formats_in_one_fused_projection(tmp_path):
    """Q4_K_M stores some v and down projections as Q6_K: qkv then fuses 4-bit groups of 32 with 8-bit groups
    of 16 into one exact byte matrix."""
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_K", v_type="Q6_K")
    native = load_model(path, torch.float32, native=True)
    reference = load_model(path, torch.float32).model
    qkv = native.model.layers[0].attn.qkv_proj
    assert (qkv.bits, qkv.group_size, qkv.formats) == (6, 16, ("Q4_K", "Q6_K"))
    assert torch.equal(qkv.dequantize(), reference.layers[0].attn.qkv_proj.weight)
    out = native.model.layers[0].mlp.gate_up_proj
    assert (out.bits, out.group_size, out.formats) == (4, 32, ("Q4_K",))


def test_float_path_unchanged_without_native(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    loaded = load_model(path, torch.float32)
    assert loaded.weights == "float"
    assert not any(isinstance(m, BlockLinear) for m in loaded.model.modules())


def test_a_type_without_an_exact_kernel_names_the_tensor_and_the_float_path(tmp_path):
    path = write_tiny_gguf(tmp_path / "iq2.gguf", "IQ2_XXS")
    with pytest.raises(ModelLoadError, match=r"token_embd.weight is stored as IQ2_XXS.*dtype='fp32'"):
        load_model(path, torch.float32, native=True)
    assert load_model(path, torch.float32).weights == "float"


@needs_kernels
def test_stored_blocks_are_read_and_packed_one_layer_at_a_time(tmp_path, monkeypatch):
    """The unpacked values (a byte per weight) of one layer at a time, not the whole model's: each layer's
    blocks are read when fusing reaches it and packed before the next layer's are read."""
    from mcp2026.loading import gguf as gguf_loading
    from mcp2026.loading import loader

    events: list[tuple[str, int]] = []
    read, pack = gguf_loading._blocks, loader._pack_blocks

    def reading(reader, t, heads):
        if t.name.startswith("blk."):
            events.append(("read", int(t.name.split(".")[1])))
        return read(reader, t, heads)

    def packing(name, weight):
        if name.startswith("layers."):
            events.append(("pack", int(name.split(".")[1])))
        return pack(name, weight)

    monkeypatch.setattr(gguf_loading, "_blocks", reading)
    monkeypatch.setattr(loader, "_pack_blocks", packing)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    load_model(path, torch.float32, native=True)
    layers = sorted({layer for _, layer in events})
    assert layers == [0, 1]
    for layer in layers[:-1]:
        last_pack = max(i for i, e in enumerate(events) if e == ("pack", layer))
        first_next_read = min(i for i, e in enumerate(events) if e == ("read", layer + 1))
        assert last_pack < first_next_read, events


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_the_token_table_is_read_and_packed_part_by_part(tmp_path, monkeypatch, type_name):
    """The token table (a whole vocabulary: the largest matrix of a small model) is read from the file a few rows
    at a time and packed as it is read, into the same buffers as packing it whole."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", type_name)
    whole = dict(load_model(path, torch.float32, native=True).model.embed_tokens.table.named_buffers())
    reads: list[tuple[int, int]] = []
    read_rows = GGUFFile.read_rows

    def spy(self, info, start, end):
        if info.name == "token_embd.weight":
            reads.append((start, end))
        return read_rows(self, info, start, end)

    monkeypatch.setattr(GGUFFile, "read_rows", spy)
    monkeypatch.setattr(block_linear, "PACK_ROWS", 32)
    parts = dict(load_model(path, torch.float32, native=True).model.embed_tokens.table.named_buffers())
    assert reads == [(a, min(a + 32, VOCAB)) for a in range(0, VOCAB, 32)]
    assert whole.keys() == parts.keys()
    for name, buffer in whole.items():
        assert buffer.dtype == parts[name].dtype and torch.equal(buffer, parts[name]), name
