"""Mixture-of-experts GGUFs written as llama.cpp's converter writes them: Qwen3-MoE ("qwen3moe") and Mixtral
("llama" with llama.expert_count), experts stacked per layer (or one tensor per expert, as older Mixtral files),
loaded against transformers on the HF folder they were converted from; quantized experts kept in their stored
blocks; routing metadata we would not apply refused."""

from __future__ import annotations

import pytest
import torch

from mcp2026.errors import ModelLoadError
from mcp2026.kernels import ops as kernel_ops
from mcp2026.loading.loader import load_model
from mcp2026.models.moe import SparseMoeBlock
from mcp2026.quant.block_linear import BlockLinear

from conftest import hf_logits, save_tiny_hf
from gguf_files import write_moe_gguf

IDS = torch.randint(0, 320, (32,), generator=torch.Generator().manual_seed(2))
ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def _ours(path, native: bool = False):
    loaded = load_model(path, dtype=torch.float32, native=native)
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(IDS, torch.arange(len(IDS)))), loaded


@pytest.mark.parametrize(
    "arch,stacked,architecture",
    [("qwen3_moe", True, "qwen3moe"), ("mixtral", True, "MixtralForCausalLM"),
     ("mixtral", False, "MixtralForCausalLM")],
    ids=["qwen3moe", "mixtral", "mixtral-per-expert-tensors"],
)  # fmt: skip
def test_gguf_matches_hf(tmp_path, arch, stacked, architecture):
    hf_dir = save_tiny_hf(tmp_path, arch=arch)
    logits, loaded = _ours(hf_dir / write_moe_gguf(hf_dir, ARCH[arch], 4, 2, stacked=stacked))
    config = loaded.config
    assert config.architecture == architecture and config.num_experts == 4 and config.num_experts_per_tok == 2
    assert config.norm_topk_prob  # llama.cpp renormalises both; the HF configs here say so too
    assert config.expert_size == (32 if arch == "qwen3_moe" else 128)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in loaded.model.layers)
    assert (logits - hf_logits(hf_dir, IDS)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_quantized_experts_load_as_floats_when_asked(tmp_path, arch):
    hf_dir = save_tiny_hf(tmp_path, arch=arch)
    logits, loaded = _ours(hf_dir / write_moe_gguf(hf_dir, ARCH[arch], 4, 2, expert_type="Q8_0"))
    assert loaded.weights == "float"
    reference = hf_logits(hf_dir, IDS)
    error = (logits - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.01  # Q8_0 of the HF experts' weights


@pytest.mark.skipif(kernel_ops.cpu.load() is None, reason="stored blocks run on the compiled CPU kernels")
def test_quantized_experts_stay_in_their_stored_blocks(tmp_path):
    hf_dir = save_tiny_hf(tmp_path, arch="qwen3_moe")
    name = write_moe_gguf(hf_dir, "qwen3moe", 4, 2, expert_type="Q8_0")
    got, native = _ours(hf_dir / name, native=True)
    expected, floats = _ours(hf_dir / name)
    assert native.weights == "native"
    for i in range(2):
        assert native.model.layers[i].mlp.router.weight.dtype == torch.float32  # the router is never blocks
        for e in range(4):
            for module in ("gate_up_proj", "down_proj"):
                name = f"layers.{i}.mlp.experts.{e}.{module}"
                linear = native.model.get_submodule(name)
                assert isinstance(linear, BlockLinear), name
                # each expert's slice of the stacked tensor, gate and up rows fused in their order
                assert torch.equal(linear.dequantize(), floats.model.get_submodule(name).weight)
    # activations rounded to int8 per 32 values before the block matmuls: the only difference
    assert (got - expected).abs().max() / expected.abs().max() < 0.03


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("expert_gating_func", 2, "expert_gating_func = 2 is a routing setting"),
        ("expert_shared_count", 1, "expert_shared_count = 1 is a routing setting"),
    ],
)
def test_routing_metadata_we_would_not_apply_is_refused(tmp_path, key, value, message):
    hf_dir = save_tiny_hf(tmp_path, arch="qwen3_moe")
    name = write_moe_gguf(
        hf_dir, "qwen3moe", 4, 2, add_extra=lambda w: w.add_uint32(f"qwen3moe.{key}", value)
    )
    with pytest.raises(ModelLoadError, match=message):
        load_model(hf_dir / name)
