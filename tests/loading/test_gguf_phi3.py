"""Phi-3 GGUFs written as llama.cpp's converter writes them (arch "phi3": fused attn_qkv, ffn_up holding gate then
up, q/k rows unpermuted, rope.dimension_count for partial rotary): loaded against transformers, as floats and with
the fused matrices kept in their stored blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from safetensors.torch import load_file

from mcp2026.errors import ModelLoadError
from mcp2026.kernels import ops as kernel_ops
from mcp2026.loading.loader import load_model
from mcp2026.quant.block_linear import BlockLinear

from conftest import save_tiny_hf
from gguf_files import byte_tokens

LAYER_NAMES = {
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
IDS = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(3))


def _write_gguf(hf_dir, rotary_factor: float = 1.0, sliding_window: int = 0, fused_type: str = "F32") -> str:
    """llama.cpp's Phi3MiniModel conversion: tensors as they are, ``fused_type`` for attn_qkv and ffn_up."""
    raw = load_file(str(hf_dir / "model.safetensors"))
    path = hf_dir / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    hidden, heads = raw["model.embed_tokens.weight"].shape[1], 4
    for key, value in {
        "context_length": 512,
        "rope.scaling.original_context_length": 512,
        "embedding_length": hidden,
        "feed_forward_length": raw["model.layers.0.mlp.down_proj.weight"].shape[1],
        "block_count": 2,
        "attention.head_count": heads,
        "attention.head_count_kv": 2,
        "rope.dimension_count": int(rotary_factor * hidden) // heads,
        "attention.sliding_window": sliding_window,  # 0 when config.json has none
    }.items():
        writer.add_uint32(f"phi3.{key}", value)
    writer.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("phi3.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(byte_tokens(320))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # else transformers' reader takes Phi-3's 32000, outside this vocabulary
    for name, t in raw.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", a)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", a)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"
            if fused_type != "F32" and module in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                qtype = gguf.GGMLQuantizationType[fused_type]
                writer.add_tensor(gguf_name, quantize(a, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.name


def _ours(path, native: bool = False) -> tuple[torch.Tensor, object]:
    loaded = load_model(path, dtype=torch.float32, native=native)
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(IDS, torch.arange(len(IDS)))), loaded


def _hf(hf_dir, gguf_file: str | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    extra = {} if gguf_file is None else {"gguf_file": gguf_file}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **extra).eval()
    with torch.no_grad():
        return model(IDS[None]).logits[0]


def test_gguf_matches_hf_and_transformers_reading_the_same_file(tmp_path):
    hf_dir = save_tiny_hf(tmp_path, arch="phi3")
    name = _write_gguf(hf_dir)
    ref = _hf(hf_dir)
    assert (_hf(hf_dir, name) - ref).abs().max().item() < 1e-4  # the file is what llama.cpp would write
    logits, loaded = _ours(hf_dir / name)
    assert loaded.config.architecture == "phi3" and loaded.config.rotary_dim is None
    assert (logits - ref).abs().max().item() < 1e-4


def test_gguf_partial_rotary_from_the_rope_dimension_count(tmp_path):
    """transformers' GGUF reader drops rope.dimension_count (it would rotate every dim); llama.cpp rotates that
    many, so the reference is the HF folder the file was converted from."""
    hf_dir = save_tiny_hf(tmp_path, arch="phi3", partial_rotary_factor=0.75)
    logits, loaded = _ours(hf_dir / _write_gguf(hf_dir, rotary_factor=0.75))
    assert loaded.config.rotary_dim == 12
    assert (logits - _hf(hf_dir)).abs().max().item() < 1e-4


def test_gguf_sliding_window_metadata_is_not_applied(tmp_path, caplog):
    """llama.cpp runs Phi-3 GGUFs without their sliding window, and transformers' GGUF reader drops it: so do we,
    and say so."""
    hf_dir = save_tiny_hf(tmp_path, arch="phi3")
    name = _write_gguf(hf_dir, sliding_window=8)
    with caplog.at_level("WARNING"):
        logits, loaded = _ours(hf_dir / name)
    assert loaded.config.sliding_window is None
    assert "attention.sliding_window=8; it runs with full attention" in caplog.text
    assert (logits - _hf(hf_dir, name)).abs().max().item() < 1e-4


@pytest.mark.skipif(kernel_ops.cpu.load() is None, reason="stored blocks run on the compiled CPU kernels")
def test_fused_matrices_stay_in_their_stored_blocks(tmp_path):
    hf_dir = save_tiny_hf(tmp_path, arch="phi3")
    name = _write_gguf(hf_dir, fused_type="Q8_0")
    got, native = _ours(hf_dir / name, native=True)
    expected, floats = _ours(hf_dir / name)
    for i in range(2):
        for module in ("attn.qkv_proj", "mlp.gate_up_proj"):
            linear = native.model.get_submodule(f"layers.{i}.{module}")
            assert isinstance(linear, BlockLinear), module
            reference = floats.model.get_submodule(f"layers.{i}.{module}").weight
            assert torch.equal(linear.dequantize(), reference)  # rows split and fused back in their order
    # activations rounded to int8 per 32 values before the block matmuls: the only difference
    assert (got - expected).abs().max() / expected.abs().max() < 0.03
    assert (got - _hf(hf_dir)).abs().max() / expected.abs().max() < 0.015  # and Q8_0 of the HF weights


def test_longrope_gguf_is_refused_clearly(tmp_path):
    hf_dir = save_tiny_hf(tmp_path, arch="phi3")
    path = hf_dir / _write_gguf(hf_dir)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "longrope.gguf"), "phi3")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data).reshape(list(reversed(t.shape.tolist()))))
    writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="LongRoPE scaling .* is not supported"):
        load_model(tmp_path / "longrope.gguf")
