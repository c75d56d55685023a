"""Model files: intact GGUF / HF folders pass; bad magic, truncation, broken safetensors headers and an
unknown architecture fail with a reason that says what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.gguf_header import read_gguf_header
from mcp2026.doctor.model_checks import check_architecture, check_model_files
from mcp2026.doctor.model_files import check_safetensors, inspect_model, model_config
from mcp2026.doctor.result import Status
from mcp2026.errors import ModelLoadError

from conftest import save_tiny_hf


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_vocab_size(32)
    writer.add_context_length(128)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((32, 16), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(16, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ctx_for(model: Path) -> DoctorContext:
    return DoctorContext(model=model)


def test_a_valid_gguf_passes_and_yields_its_config(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    header = read_gguf_header(path)
    assert header.version == 3 and len(header.tensors) == 3
    assert header.data_end <= header.file_bytes
    assert {t.name: t.nbytes for t in header.tensors}["token_embd.weight"] == 32 * 16 * 4
    ctx = ctx_for(path)
    files = check_model_files(ctx)
    assert files.status is Status.PASS, files.reason
    assert files.details["num_tensors"] == 3
    arch = check_architecture(ctx)
    assert arch.status is Status.PASS and arch.details["architecture"] == "llama"
    cfg = model_config(inspect_model(path))
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (16, 2, 1, 32)


def test_bad_magic_fails(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = bytearray(path.read_bytes())
    data[:4] = b"GGUX"
    path.write_bytes(bytes(data))
    result = check_model_files(ctx_for(path))
    assert result.status is Status.FAIL and "bad magic" in result.reason
    assert check_architecture(ctx_for(path)).status is Status.SKIP


@pytest.mark.parametrize("keep", ["data", "header"])
def test_truncated_gguf_fails(tmp_path, keep):
    whole = write_tiny_gguf(tmp_path / "whole.gguf")
    header = read_gguf_header(whole)
    data = whole.read_bytes()
    # cut inside the tensor data, or inside the metadata
    cut = header.data_end - 100 if keep == "data" else header.data_start // 2
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    result = check_model_files(ctx_for(path))
    assert result.status is Status.FAIL
    assert "truncated" in result.reason


def test_hf_folder_passes(tiny_llama_dir):
    result = check_model_files(ctx_for(tiny_llama_dir))
    assert result.status is Status.PASS, result.reason
    assert result.details["format"] == "safetensors"
    assert check_architecture(ctx_for(tiny_llama_dir)).status is Status.PASS


def test_unknown_architecture_fails_listing_supported_ones(tmp_path):
    folder = save_tiny_hf(tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(raw))
    assert check_model_files(ctx_for(folder)).status is Status.PASS  # the files are fine
    result = check_architecture(ctx_for(folder))
    assert result.status is Status.FAIL
    assert "MambaForCausalLM" in result.reason and "LlamaForCausalLM" in result.reason


def test_broken_config_json_fails(tmp_path):
    folder = save_tiny_hf(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    result = check_model_files(ctx_for(folder))
    assert result.status is Status.FAIL and "not valid JSON" in result.reason


def test_safetensors_header_and_data_are_checked(tmp_path):
    folder = save_tiny_hf(tmp_path / "m")
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    assert sum(check_safetensors(weights).values()) > 0
    weights.write_bytes(good[:-10])  # truncated data
    with pytest.raises(ModelLoadError, match="truncated"):
        check_safetensors(weights)
    weights.write_bytes((10**12).to_bytes(8, "little") + good[8:])  # absurd header length
    with pytest.raises(ModelLoadError, match="header length"):
        check_safetensors(weights)
    length = int.from_bytes(good[:8], "little")
    weights.write_bytes(good[:8] + b"[" + good[9 : 8 + length] + good[8 + length :])  # JSON broken
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        check_safetensors(weights)


def test_missing_model_fails(tmp_path):
    result = check_model_files(ctx_for(tmp_path / "nope.gguf"))
    assert result.status is Status.FAIL and "no such file" in result.reason
