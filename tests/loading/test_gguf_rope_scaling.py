"""Rope scaling read from files: GGUFs written the way llama.cpp's converter writes a scaled Llama (YaRN as
metadata keys, Llama 3.1 as the per-dimension ``rope_freqs`` tensor) run as transformers runs the source model;
scalings we do not run are one-line load errors from config.json and from GGUF metadata alike."""

from __future__ import annotations

import json
import math

import gguf
import pytest
import torch

from mcp2026.errors import ModelLoadError
from mcp2026.loading.loader import load_model
from mcp2026.models.rotary import RotaryEmbedding
from mcp2026.rope_types import HF_ROPE_TYPES

from conftest import save_tiny_hf
from gguf_files import write_converted_gguf

TOKENS, ORIGINAL, HEAD_DIM = 40, 16, 16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "attention_factor": 1.2}


def llama_cpp_rope_freqs(scaling: dict, theta: float = 10000.0) -> torch.Tensor:
    """Llama 3.1 scaling as llama.cpp's converter stores it: each dimension's frequency divisor."""
    freqs = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    low_wavelen, high_wavelen = ORIGINAL / low, ORIGINAL / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (ORIGINAL / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def add_llama3(writer: gguf.GGUFWriter) -> None:
    writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(LLAMA3).numpy())


def add_yarn(writer: gguf.GGUFWriter) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(YARN["factor"])
    writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
    writer.add_rope_scaling_yarn_attn_factor(YARN["attention_factor"])
    writer.add_rope_scaling_yarn_beta_fast(YARN["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(YARN["beta_slow"])


@pytest.mark.parametrize(
    "scaling,add_extra", [(LLAMA3, add_llama3), (YARN, add_yarn)], ids=["llama3-rope_freqs", "yarn"]
)
def test_scaled_gguf_matches_hf_source(tmp_path, scaling, add_extra):
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_hf(tmp_path, rope_scaling={**scaling, "original_max_position_embeddings": ORIGINAL})
    name = write_converted_gguf(hf_dir, "llama", heads=4, kv_heads=2, add_extra=add_extra)
    tokens = torch.randint(0, 320, (TOKENS,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens[None]).logits[0]
        loaded = load_model(hf_dir / name, dtype=torch.float32)
        model, c = loaded.model, loaded.config
        logits = model.compute_logits(model(tokens, torch.arange(TOKENS)))
        model.rope = RotaryEmbedding(c.head_dim, model.max_positions, c.rope_theta, None)
        unscaled = model.compute_logits(model(tokens, torch.arange(TOKENS)))
    assert (logits - ref).abs().max().item() < 1e-4
    assert (unscaled - ref).abs().max().item() > 1e-3  # the scaling acts on this input


def expect_one_line_error(path, *phrases: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype=torch.float32)
    message = str(info.value)
    assert "\n" not in message and all(p in message for p in phrases), message


@pytest.mark.parametrize("rope_type", ["longrope", "su", "ntk-by-parts"])
def test_unsupported_rope_type_in_config_json_is_a_load_error(tmp_path, rope_type):
    folder = save_tiny_hf(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 16}
    (folder / "config.json").write_text(json.dumps(config))
    expect_one_line_error(folder, "config.json", repr(rope_type), ", ".join(HF_ROPE_TYPES))


def test_unsupported_rope_type_in_gguf_is_a_load_error(tmp_path):
    def add_longrope(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)

    hf_dir = save_tiny_hf(tmp_path)
    name = write_converted_gguf(hf_dir, "llama", heads=4, kv_heads=2, add_extra=add_longrope)
    expect_one_line_error(
        hf_dir / name, name, "llama.rope.scaling.type", "'longrope'", ", ".join(HF_ROPE_TYPES)
    )


def test_yarn_setting_transformers_lacks_is_a_load_error(tmp_path):
    def add_yarn_ext(writer: gguf.GGUFWriter) -> None:
        add_yarn(writer)
        writer.add_rope_scaling_yarn_ext_factor(0.5)

    hf_dir = save_tiny_hf(tmp_path)
    name = write_converted_gguf(hf_dir, "llama", heads=4, kv_heads=2, add_extra=add_yarn_ext)
    expect_one_line_error(hf_dir / name, "llama.rope.scaling.yarn_ext_factor", "not supported")
