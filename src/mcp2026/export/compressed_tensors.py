"""A quantized model as a Hugging Face folder in the compressed-tensors format, which transformers and vLLM read:
model.safetensors (int4 and int8 linears "pack-quantized": int32 words, scales per group or row, zero points;
fp8 ones "float-quantized"), config.json with its ``quantization_config`` (one config group per scheme, naming its
layers; float linears under ``ignore``), and the tokenizer files.

Exact where the format holds our values: int8 rows, symmetric int4, fp8. Its asymmetric int4 has integer zero
points (w = (q - zp) * s) where ours are floats (w = (u - 8) * s + zero): each group's zero becomes the nearest
integer multiple of its scale, which moves a group's weights by up to half a step (the report gives the largest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from mcp2026.config import ModelConfig
from mcp2026.errors import ExportError
from mcp2026.export.layout import Weight, is_tied, unfused_weights
from mcp2026.export.matrices import FloatMatrix, Fp8Rows, Int4Groups, Int8Rows, StoredBlocks
from mcp2026.export.report import CONVERTED, FLOAT, PACKED, ExportReport, TensorRecord, check_new_path
from mcp2026.loading.compressed_tensors import FLOAT_QUANTIZED, PACK_QUANTIZED, QUANT_METHOD, pack_int32
from mcp2026.loading.names import HF_GLOBAL_NAMES, HF_LAYER_NAMES
from mcp2026.quant.artifact import save_tokenizer
from mcp2026.quant.quantizer import SCALE_DTYPE

HF_ARCHITECTURES = {  # ours -> (transformers class, model_type)
    "LlamaForCausalLM": ("LlamaForCausalLM", "llama"), "llama": ("LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ("MistralForCausalLM", "mistral"), "mistral": ("MistralForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", "qwen2"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ("Qwen3ForCausalLM", "qwen3"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}  # fmt: skip
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_name(ours: str) -> str:
    """transformers' name of the tensor the loaders call ``ours`` (the inverse of ``loading.names.map_name``)."""
    if ours.startswith("layers."):
        _, index, rest = ours.split(".", 2)
        return f"model.layers.{index}.{ {v: k for k, v in HF_LAYER_NAMES.items()}[rest] }"
    return {v: k for k, v in HF_GLOBAL_NAMES.items()}[ours]


def _int4(module: str, m: Int4Groups) -> tuple[dict[str, Tensor], dict[str, Any], str, float]:
    """(tensors, weights scheme, origin, max error) of an int4 linear."""
    n, k = m.u.shape
    q = m.u.to(torch.int8) - 8  # (N, K) in -8..7
    tensors = {"weight_packed": pack_int32(q, 4), "weight_scale": m.scale.to(SCALE_DTYPE),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}  # fmt: skip
    scheme = {
        "num_bits": 4,
        "type": "int",
        "symmetric": m.symmetric,
        "strategy": "group",
        "group_size": m.group_size,
    }
    if m.symmetric:
        return tensors, scheme, PACKED, 0.0
    zero_point = torch.round(-m.zero / m.scale).clamp(-8, 7)  # (N, G): the integer zero nearest to ours
    tensors["weight_zero_point"] = pack_int32(zero_point, 4, dim=0)
    written = Int4Groups(m.u, m.scale, -zero_point * m.scale, m.group_size)
    return tensors, scheme, CONVERTED, float((written.dequantize() - m.dequantize()).abs().max())


def _linear(module: str, m: Weight) -> tuple[dict[str, Tensor], dict[str, Any] | None, str, float]:
    """(tensors under the module, weights scheme or None for a float linear, origin, max error)."""
    if isinstance(m, StoredBlocks):
        raise ExportError(
            f"{module}: runs {'+'.join(m.formats)} blocks as a GGUF stored them; compressed-tensors holds the "
            "models mcp2026 quantizes: compile the model (or export it to GGUF)"
        )
    if isinstance(m, FloatMatrix):
        return {"weight": m.weight.contiguous()}, None, FLOAT, 0.0
    if isinstance(m, Int8Rows):
        n, k = m.q.shape
        scale = m.scale if m.grouped else m.scale[:, None]
        tensors = {"weight_packed": pack_int32(m.q, 8), "weight_scale": scale.to(SCALE_DTYPE),
                   "weight_shape": torch.tensor([n, k], dtype=torch.int64)}  # fmt: skip
        scheme = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
        if m.grouped:
            scheme = {**scheme, "strategy": "group", "group_size": k // scale.shape[1]}
        return tensors, scheme, PACKED, 0.0
    if isinstance(m, Fp8Rows):
        tensors = {"weight": m.weight.contiguous(), "weight_scale": m.scale[:, None].float()}
        return (
            tensors,
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            PACKED,
            0.0,
        )
    return _int4(module, m)


def _quantization_config(schemes: dict[str, dict[str, Any]], ignore: list[str]) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = {}
    for module, scheme in schemes.items():
        key = json.dumps(scheme, sort_keys=True)
        if key not in groups:
            fmt = FLOAT_QUANTIZED if scheme["type"] == "float" else PACK_QUANTIZED
            weights = {**scheme, "group_size": scheme.get("group_size"), "dynamic": False, "actorder": None,
                       "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
            groups[key] = {"targets": [], "weights": weights, "input_activations": None,
                           "output_activations": None, "format": fmt}  # fmt: skip
        groups[key]["targets"].append(module)
    formats = {g["format"] for g in groups.values()}
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def hf_config(config: ModelConfig, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for ``config`` (what ``loading.hf.config_from_hf`` reads back, and transformers)."""
    if (config.rope_scaling or {}).get("rope_type") == "freq_factors":
        raise ExportError(
            "the model's rope scaling is a GGUF rope_freqs tensor, which a Hugging Face config has no field for; "
            "export it to GGUF"
        )
    architecture, model_type = HF_ARCHITECTURES[config.architecture]
    eos = list(config.eos_token_ids)
    out = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": tied,
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "sliding_window": config.sliding_window, "torch_dtype": DTYPE_NAMES.get(dtype, "float32"),
    }  # fmt: skip
    if model_type == "llama":
        out["attention_bias"] = config.attention_bias
    return out


def export_compressed_tensors(loaded: Any, out: str | Path) -> ExportReport:
    """Write ``loaded`` (a ``loading.loader.LoadedModel`` quantized by a plan) as the folder ``out``."""
    folder = check_new_path(out)
    config: ModelConfig = loaded.config
    weights = unfused_weights(loaded.model, config)
    report = ExportReport(folder, "compressed-tensors")
    state: dict[str, Tensor] = {}
    schemes: dict[str, dict[str, Any]] = {}
    ignore: list[str] = []
    for ours, value in weights.items():
        name = hf_name(ours)
        if isinstance(value, Tensor) or name == "model.embed_tokens.weight":
            tensor = value if isinstance(value, Tensor) else _linear(name, value)[0]["weight"]
            state[name] = tensor.contiguous()
            report.add(TensorRecord(name, str(tensor.dtype).removeprefix("torch."), FLOAT, 0.0, 0.0))
            continue
        module = name.removesuffix(".weight")
        tensors, scheme, origin, error = _linear(module, value)
        state.update({f"{module}.{part}": t for part, t in tensors.items()})
        if scheme is None:
            ignore.append(module)
            kind = str(value.weight.dtype).removeprefix("torch.")
        else:
            schemes[module] = scheme
            kind = f"{scheme['type']}{scheme['num_bits']} " + (
                f"g{scheme['group_size']} {'sym' if scheme['symmetric'] else 'asym'}"
                if scheme.get("group_size")
                else "per row"
            )
        report.add(TensorRecord(name, kind, origin, error, float(value.dequantize().abs().max())))
    if not schemes:
        raise ExportError(
            "the model has no quantized linear; compressed-tensors export is for a compiled plan"
        )
    tied = is_tied(loaded.model)
    if tied:
        ignore.append("lm_head")
    dtype = loaded.model.norm.weight.dtype
    raw = {**hf_config(config, tied, dtype), "quantization_config": _quantization_config(schemes, ignore)}
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    save_tokenizer(loaded.tokenizer, folder)
    if any(r.origin == CONVERTED for r in report.tensors):
        report.notes.append(
            "int4 asym layers: compressed-tensors stores integer zero points; each group's zero was rounded to the "
            "nearest multiple of its scale (for an exact export use symmetric int4, or GGUF)"
        )
    return report
