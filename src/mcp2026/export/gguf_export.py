"""A model as a GGUF file llama.cpp loads: each linear in the GGUF type holding the values mcp2026 runs (int8 rows
-> Q8_0, symmetric int4 -> Q4_0, int4 with zero points -> Q4_1), tensors the model holds as the source GGUF stored
them written back byte for byte, floats as F32 / F16 / BF16; llama.cpp's names, q/k row order and metadata; the
tokenizer and chat template carried over (``gguf_vocab``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from torch import Tensor

from mcp2026.config import ModelConfig
from mcp2026.errors import ExportError
from mcp2026.export import gguf_packing
from mcp2026.export.gguf_vocab import add_vocab
from mcp2026.export.layout import Weight, unfused_weights
from mcp2026.export.matrices import FloatMatrix, Fp8Rows, Int4Groups, Int8Rows, StoredBlocks
from mcp2026.export.report import FLOAT, PACKED, SOURCE, ExportReport, TensorRecord, check_new_path
from mcp2026.loading.gguf_file import GGUFFile, GGUFTensorInfo
from mcp2026.loading.names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from mcp2026.models.registry import family_of
from mcp2026.models.rotary import rope_inv_freq

# Our architecture names -> llama.cpp's (its converter writes Mistral as llama)
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
}  # fmt: skip
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
              "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}  # fmt: skip
# A tensor equal to the source file's within this (fp32 rounding of the query scale taken out and put back)
SOURCE_RTOL = 1e-6
# general.* keys of a GGUF source that describe the model (not the file), copied to the export
_FILE_KEYS = (
    "general.architecture",
    "general.alignment",
    "general.file_type",
    "general.quantization_version",
)


def gguf_name(ours: str, config: ModelConfig) -> str:
    """llama.cpp's name of the tensor the loaders call ``ours`` (the inverse of ``loading.names.map_name``)."""
    layer_names = {**GGUF_LAYER_NAMES, **family_of(config.architecture).gguf_layer_names}
    if ours.startswith("layers."):
        _, index, rest = ours.split(".", 2)
        inverse = {v: k for k, v in layer_names.items()}
        return f"blk.{index}.{inverse[rest]}"
    return {v: k for k, v in GGUF_GLOBAL_NAMES.items()}[ours]


def permuted_rows(rows: int, heads: int) -> Tensor:
    """llama.cpp's converter permute of q/k rows (rotate-half pairs interleaved) as an index into our rows."""
    return torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)


def _permute(ours: str, value: Weight, config: ModelConfig) -> Weight:
    if not family_of(config.architecture).gguf_rope_permuted:
        return value
    heads = {"q": config.num_heads, "k": config.num_kv_heads}.get(ours.rsplit(".", 2)[-2])
    if heads is None:
        return value
    index = permuted_rows(value.shape[0], heads)
    return value.index_select(0, index) if isinstance(value, Tensor) else value.rows(index)


def _source_bytes(
    name: str, value: FloatMatrix | StoredBlocks, source: GGUFFile | None, info: GGUFTensorInfo | None
):
    """The source tensor's bytes when its values are the ones ``value`` holds, else None."""
    if source is None or info is None or info.shape != tuple(value.shape):
        return None
    raw = source.raw(info)
    stored = torch.from_numpy(np.array(dequantize(raw, info.tensor_type), dtype=np.float32)).view(info.shape)
    if not torch.allclose(value.dequantize(), stored, rtol=SOURCE_RTOL, atol=0.0):
        return None
    return np.array(raw)


def _float_array(weight: Tensor) -> tuple[np.ndarray, Any, str]:
    if weight.dtype == torch.bfloat16:
        return weight.contiguous().view(torch.uint8).numpy(), gguf.GGMLQuantizationType.BF16, "BF16"
    if weight.dtype == torch.float16:
        return weight.numpy(), None, "F16"
    return weight.float().numpy(), None, "F32"


def _encode(name: str, value: Weight, source: GGUFFile | None, info: GGUFTensorInfo | None):
    """(array, raw ggml type or None, record) of one tensor."""
    if isinstance(value, Tensor):  # norms and biases: F32, as llama.cpp's converter writes 1-D tensors
        return value.float().numpy(), None, TensorRecord(name, "F32", FLOAT, 0.0, float(value.abs().max()))
    ours = value.dequantize()
    peak = float(ours.abs().max())
    if isinstance(value, (FloatMatrix, StoredBlocks)):
        raw = _source_bytes(name, value, source, info)
        if raw is not None:
            return raw, info.tensor_type, TensorRecord(name, info.tensor_type.name, SOURCE, 0.0, peak)
        if isinstance(value, StoredBlocks):
            raise ExportError(
                f"{name}: runs stored {'+'.join(value.formats)} blocks that no longer match the source GGUF; "
                "export needs the file the model was loaded from"
            )
        array, raw_type, type_name = _float_array(value.weight)
        return array, raw_type, TensorRecord(name, type_name, FLOAT, 0.0, peak)
    if isinstance(value, Fp8Rows):
        raise ExportError(f"{name}: fp8 weights have no GGUF type; compile this layer as int8 to export it")
    if isinstance(value, Int8Rows):
        type_name, array = "Q8_0", gguf_packing.q8_0(name, value)
    elif isinstance(value, Int4Groups):
        type_name, array = gguf_packing.q4(name, value)
    qtype = gguf.GGMLQuantizationType[type_name]
    written = torch.from_numpy(np.array(dequantize(array, qtype), dtype=np.float32)).view(ours.shape)
    error = float((written - ours).abs().max())
    return array, qtype, TensorRecord(name, type_name, PACKED, error, peak)


def _check_config(config: ModelConfig) -> None:
    scaling = config.rope_scaling or {}
    problems = [
        config.attention_scale is not None and config.attention_scale != config.head_dim**-0.5
        and "a query scale other than 1/sqrt(head_dim)",
        config.sliding_window is not None and config.sliding_window < config.max_position_embeddings
        and f"sliding-window attention ({config.sliding_window} positions)",
        config.final_logit_softcapping is not None and "logit soft-capping",
        scaling.get("rope_type") == "dynamic" and "dynamic NTK rope scaling",
        config.rotary_dim is not None and "partial rotary",
    ]  # fmt: skip
    problems = [p for p in problems if p]
    if problems:
        raise ExportError(f"a {config.architecture} GGUF cannot express {', '.join(problems)}")


def _add_model_keys(writer: gguf.GGUFWriter, config: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """The architecture's hyperparameters; returns the extra tensors the rope scaling needs (rope_freqs)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    if config.head_dim != config.hidden_size // config.num_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    scaling = config.rope_scaling
    if scaling is None:
        return []
    kind = scaling["rope_type"]
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor)):  # fmt: skip
            if scaling.get(key) is not None:
                add(float(scaling[key]))
    if kind in ("llama3", "freq_factors"):  # llama.cpp's per-dimension divisors, as its converter stores them
        plain = rope_inv_freq(config.head_dim, config.rope_theta, None).double()
        factors = plain / rope_inv_freq(config.head_dim, config.rope_theta, scaling).double()
        return [("rope_freqs.weight", factors.float().numpy())]
    return []


def _copy_general_keys(writer: gguf.GGUFWriter, source: GGUFFile | None, fallback_name: str) -> None:
    if source is None:
        writer.add_name(fallback_name)
        return
    for key, value in source.metadata.items():
        if key.startswith("general.") and key not in _FILE_KEYS:
            kind, item_kind = source.value_types[key]
            sub_type = None if item_kind is None else gguf.GGUFValueType(item_kind)
            writer.add_key_value(key, value, gguf.GGUFValueType(kind), sub_type)


def export_gguf(loaded: Any, out: str | Path) -> ExportReport:
    """Write ``loaded`` (a ``loading.loader.LoadedModel``, quantized or not) as the GGUF file ``out``."""
    path = check_new_path(out, ".gguf")
    config: ModelConfig = loaded.config
    weights = unfused_weights(loaded.model, config)
    arch = GGUF_ARCHITECTURES[config.architecture]
    _check_config(config)
    source = GGUFFile.open(loaded.source) if loaded.file_format == "gguf" else None
    source_infos = {t.name: t for t in source.tensors} if source is not None else {}
    report = ExportReport(path, "gguf")
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    try:
        _copy_general_keys(writer, source, Path(loaded.source).stem)
        extra = _add_model_keys(writer, config)
        add_vocab(writer, loaded.tokenizer, source)
        for name, array in extra:
            writer.add_tensor(name, array)
            report.add(TensorRecord(name, "F32", FLOAT, 0.0, float(np.abs(array).max())))
        for ours, value in weights.items():
            name = gguf_name(ours, config)
            array, raw_type, record = _encode(
                name, _permute(ours, value, config), source, source_infos.get(name)
            )
            writer.add_tensor(name, array, raw_dtype=raw_type)
            report.add(record)
        matrices = Counter(
            r.type_name for r in report.tensors if r.name.endswith(".weight") and r.type_name != "F32"
        )
        file_type = FILE_TYPES.get(matrices.most_common(1)[0][0]) if matrices else gguf.LlamaFileType.ALL_F32
        if file_type is not None:
            writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.rename(path)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return report
