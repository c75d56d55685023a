"""HF model folders: config.json + safetensors (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mcp2026.config import ModelConfig
from mcp2026.errors import ModelLoadError
from mcp2026.loading.compressed_tensors import PARTS, compression_of, read_compressed
from mcp2026.loading.names import HF_GLOBAL_NAMES, HF_LAYER, HF_LAYER_NAMES, Weight, map_name
from mcp2026.loading.progress import load_progress
from mcp2026.loading.rope_scaling import normalized_rope_scaling
from mcp2026.models.registry import family_of, resolve_architecture


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _rope_params(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None, int]:
    """(rope theta, rope scaling, context length)."""
    # transformers >= 5 writes "rope_parameters"; older configs "rope_theta" + "rope_scaling".
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params or None
    max_positions = int(raw.get("max_position_embeddings", 4096))
    return theta, *normalized_rope_scaling(scaling, max_positions, source)


def config_from_hf(raw: dict[str, Any], source: str) -> ModelConfig:
    arch = resolve_architecture(raw.get("architectures") or raw.get("model_type") or [], source)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, scaling, context = _rope_params(raw, source)
        eos = raw.get("eos_token_id")
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )
        family_fields = family_of(arch).hf_config(raw)
        if "rope_scaling" in family_fields:  # a family's own rotary fields (Gemma 3: per kind of layer)
            family_fields["rope_scaling"], _ = normalized_rope_scaling(
                family_fields["rope_scaling"], context, source
            )
        return ModelConfig(**{**fields, **family_fields})
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: inconsistent config.json: {e}") from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise ModelLoadError(f"{index}: weight_map is empty")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder}: no *.safetensors weights found (pytorch .bin files are not supported)"
        )
    return files


# safetensors' dtype names -> torch's
_STORED_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I8": "int8",
    "U8": "uint8",
    "I32": "int32",
    "I64": "int64",
    "F8_E4M3": "float8_e4m3fn",
}


def stored_tensor_formats(folder: Path) -> dict[str, int]:
    """How many tensors the folder's safetensors files store in each dtype, as stored (before any cast)."""
    counts: dict[str, int] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                stored = handle.get_slice(name).get_dtype()
                key = _STORED_DTYPES.get(stored, stored.lower())
                counts[key] = counts.get(key, 0) + 1
    return counts


def _compressed_modules(handles: list, quant: dict[str, Any] | None) -> set[str]:
    """The modules whose weight a compressed-tensors folder stores quantized (their tensors are read together)."""
    if quant is None:
        return set()
    names = [n for _, h in handles for n in h.keys()]  # noqa: SIM118 - safe_open handles are not iterable
    return {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight_packed", ".weight_scale"))}


def load_hf_tensors(
    folder: Path, dtype: torch.dtype, config: ModelConfig, native: bool = False
) -> dict[str, Weight]:
    """All weights under our intermediate names, converted to ``dtype``; a compressed-tensors folder's quantized
    linears as ``BlockWeights`` with ``native`` (their stored values, exactly), else dequantized to ``dtype``."""
    tensors: dict[str, Weight] = {}
    quant = compression_of(read_json(folder / "config.json"))
    family = family_of(config.architecture)
    layer_names = {**HF_LAYER_NAMES, **family.hf_layer_names}
    files = weight_files(folder)
    handles = []
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{f}: shard listed in model.safetensors.index.json is missing")
        try:
            handles.append((f, safe_open(str(f), framework="pt")))
        except Exception as e:  # safetensors raises its own SafetensorError for truncated/corrupt headers
            raise ModelLoadError(f"{f}: corrupted or truncated safetensors file ({e})") from None
    total = sum(len(list(h.keys())) for _, h in handles)  # noqa: SIM118
    compressed = _compressed_modules(handles, quant)
    parts: dict[str, dict[str, torch.Tensor]] = {m: {} for m in compressed}
    with load_progress(f"loading {folder.name}", total) as advance:
        for f, handle in handles:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                module, _, part = name.rpartition(".")
                if module in compressed and part in ("weight", *PARTS):
                    parts[module][part] = _read(f, handle, name)
                    advance(1)
                    continue
                ours = map_name(name, HF_LAYER, layer_names, HF_GLOBAL_NAMES, config.architecture)
                t = _read(f, handle, name)
                if ours is not None and ours.endswith("norm.weight") and family.hf_norm_offset:
                    # added in float32: in a bf16 checkpoint's own dtype, 1 + w would lose w's low bits before
                    # an fp32 model reads it
                    t = t.float() + family.hf_norm_offset
                if ours is not None:
                    tensors[ours] = t.to(dtype)
                advance(1)
    for module, module_parts in parts.items():
        ours = map_name(f"{module}.weight", HF_LAYER, layer_names, HF_GLOBAL_NAMES, config.architecture)
        if ours is not None:
            tensors[ours] = read_compressed(module, module_parts, quant, native, dtype)
    return tensors


def _read(file: Path, handle: Any, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as e:
        raise ModelLoadError(
            f"{file}: tensor {name} cannot be read, the file is truncated or corrupted ({e})"
        ) from None
