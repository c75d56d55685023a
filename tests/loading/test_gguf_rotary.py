"""GGUF q/k rows in llama.cpp's layout per family: the Llama converter permutes them for its interleaved
rotary, the Qwen2 one does not (llama.cpp runs Qwen2 with NeoX rotary). Each file is written the way
llama.cpp's converter writes it; transformers reading the same file is the check that the layout is right."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mcp2026.loading.loader import load_model

from conftest import save_tiny_hf
from gguf_files import byte_tokens

LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert permute for Llama q/k rows (HF rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_dir, arch: str, heads: int, kv_heads: int) -> str:
    raw = load_file(str(hf_dir / "model.safetensors"))
    path = hf_dir / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    hidden = raw["model.embed_tokens.weight"].shape[1]
    for key, value in {
        "context_length": 512,
        "embedding_length": hidden,
        "feed_forward_length": raw["model.layers.0.mlp.up_proj.weight"].shape[0],
        "block_count": 2,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(byte_tokens(320))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(2)
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
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _llama_cpp_permute(a, heads if module.endswith("q_proj") else kv_heads)
            writer.add_tensor(f"blk.{layer}.{LAYER_NAMES[module]}.{kind}", a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_rotary_layout_matches_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_hf(tmp_path, arch=arch)
    name = _write_gguf(hf_dir, arch, heads=4, kv_heads=2)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids[None]).logits[0]
        from_file = AutoModelForCausalLM.from_pretrained(hf_dir, gguf_file=name, dtype=torch.float32)
        assert (from_file.eval()(ids[None]).logits[0] - ref).abs().max().item() < 1e-4  # the file is right
        ours = load_model(hf_dir / name, dtype=torch.float32)
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids))))
    assert (logits - ref).abs().max().item() < 1e-4
