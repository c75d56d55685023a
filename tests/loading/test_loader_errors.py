"""Bad model inputs: each gives one ModelLoadError naming the file and the problem, never a library traceback."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from mcp2026.errors import ModelLoadError, UnsupportedArchitectureError
from mcp2026.loading.loader import load_model

from conftest import save_tiny_hf


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> dict[str, bytes]:
    """A valid tiny HF folder's files; each test copies them and damages its copy."""
    folder = save_tiny_hf(tmp_path_factory.mktemp("tiny_source"))
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


@pytest.fixture
def tiny_dir(tmp_path, tiny_bytes) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    for name, data in tiny_bytes.items():
        (folder / name).write_bytes(data)
    return folder


def edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


def expect_error(path: Path, names: str, phrase: str, kind: type[Exception] = ModelLoadError) -> str:
    with pytest.raises(kind) as info:
        load_model(path, dtype=torch.float32)
    message = str(info.value)
    assert names in message and phrase in message, message
    assert "\n" not in message
    return message


def test_valid_tiny_dir_loads(tiny_dir):
    assert load_model(tiny_dir).config.hidden_size == 64


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nowhere", "nowhere", "no such file or directory")


def test_empty_dir(tmp_path):
    expect_error(tmp_path, "config.json", "not found")


def test_config_without_weights(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    expect_error(tiny_dir, str(tiny_dir), "no *.safetensors weights found")


def test_config_not_json(tiny_dir):
    (tiny_dir / "config.json").write_text("{'hidden_size': 64,")
    expect_error(tiny_dir, "config.json", "not valid JSON")


def test_config_lacks_required_field(tiny_dir):
    edit_config(tiny_dir, num_hidden_layers=None)
    expect_error(tiny_dir, "config.json", "lacks required field 'num_hidden_layers'")


def test_unknown_architecture_lists_supported(tiny_dir):
    edit_config(tiny_dir, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    message = expect_error(tiny_dir, "config.json", "GPTNeoXForCausalLM", UnsupportedArchitectureError)
    assert "not supported" in message
    assert all(name in message for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"))


def test_hidden_size_not_matching_weights(tiny_dir):
    edit_config(tiny_dir, hidden_size=128)
    expect_error(tiny_dir, str(tiny_dir), "the config does not match the weights")


def test_more_layers_in_weights_than_config(tiny_dir):
    edit_config(tiny_dir, num_hidden_layers=1)
    expect_error(tiny_dir, str(tiny_dir), "the config does not match the weights")


def test_num_heads_not_multiple_of_kv_heads(tiny_dir):
    edit_config(tiny_dir, num_key_value_heads=3)
    expect_error(tiny_dir, "config.json", "must be a multiple of num_kv_heads")


def test_truncated_safetensors(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    expect_error(tiny_dir, "model.safetensors", "corrupted or truncated safetensors")


@pytest.mark.parametrize("garbage", [b"\xff" * 16, b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage"])
def test_corrupted_safetensors_header(tiny_dir, garbage):
    weights = tiny_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(garbage + data[len(garbage) :])
    expect_error(tiny_dir, "model.safetensors", "corrupted or truncated safetensors")


def test_index_points_to_missing_shard(tiny_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:3]}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in names[3:]}
    (tiny_dir / "model-00001-of-00002.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    (tiny_dir / "model.safetensors").unlink()
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_error(tiny_dir, "model-00002-of-00002.safetensors", "is missing")


# --- GGUF ---------------------------------------------------------------------------------------


def write_gguf(path: Path, arch: str, drop: str = "", changes: dict[str, int] | None = None) -> Path:
    """A metadata-only GGUF (no tensors): enough to reach the config checks."""
    writer = gguf.GGUFWriter(str(path), arch)
    fields = {
        "context_length": 64,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "block_count": 2,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
    } | (changes or {})
    for key, value in fields.items():
        if key != drop:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_bad_magic(tmp_path, default_model_path):
    path = tmp_path / "bad_magic.gguf"
    with open(default_model_path, "rb") as f:
        path.write_bytes(b"GGML" + f.read(4096)[4:])
    expect_error(path, "bad_magic.gguf", "not a GGUF file")


def test_gguf_not_gguf_at_all(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hi")
    expect_error(path, "notes.gguf", "not a GGUF file")


@pytest.mark.parametrize("keep", [2**20, 0.9], ids=["first-1MiB", "first-90pct"])
def test_gguf_truncated(tmp_path, default_model_path, keep):
    size = default_model_path.stat().st_size
    num_bytes = keep if isinstance(keep, int) else int(size * keep)
    path = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        path.write_bytes(f.read(num_bytes))
    expect_error(path, "truncated.gguf", "truncated or corrupted GGUF file")


def test_gguf_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "neox.gguf", "gptneox")
    message = expect_error(path, "neox.gguf", "gptneox", UnsupportedArchitectureError)
    assert "not supported" in message and "llama" in message and "qwen2" in message


def test_gguf_missing_metadata_key(tmp_path):
    path = write_gguf(tmp_path / "partial.gguf", "llama", drop="feed_forward_length")
    expect_error(path, "partial.gguf", "GGUF metadata lacks llama.feed_forward_length")


def test_gguf_inconsistent_heads(tmp_path):
    path = write_gguf(tmp_path / "heads.gguf", "llama", changes={"attention.head_count_kv": 3})
    expect_error(path, "heads.gguf", "must be a multiple of num_kv_heads")
