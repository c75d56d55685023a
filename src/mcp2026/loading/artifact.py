"""Loading a compiled model folder (``quant.artifact`` writes it): the skeleton with each quantized layer's module
in place, the packed weights (repacked for this CPU's int4 layout), the tokenizer; no recalibration."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from mcp2026.config import ModelConfig
from mcp2026.errors import ModelLoadError
from mcp2026.loading.tokenizer import Tokenizer
from mcp2026.models.registry import build_model_skeleton
from mcp2026.quant.artifact import WEIGHTS_FILE, read_metadata
from mcp2026.quant.int4_packing import int4pack_block_rows, pack_int4, unpack_int4
from mcp2026.quant.linear import Int4Linear, QuantLinear, empty_module
from mcp2026.quant.plan import LayerQuantSpec


def _build(config: ModelConfig, layers: dict[str, dict]) -> nn.Module:
    """The model skeleton on the meta device, with each quantized layer's module in place."""
    model = build_model_skeleton(config)
    with torch.device("meta"):
        for name, info in layers.items():
            spec = LayerQuantSpec(**info["spec"])
            linear = model.get_submodule(name)
            module = empty_module(linear, spec, getattr(torch, info["compute_dtype"]))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
    return model


# Artifacts written before the layout was recorded were all compiled on AVX2 machines (32-row blocks).
LEGACY_INT4_BLOCK_ROWS = 32


def _repack_int4(model: nn.Module, saved_block_rows: int) -> None:
    """torch packs int4 weights per CPU kind (64-row blocks with AVX-512, 32 with AVX2): an artifact
    compiled on another kind of CPU is repacked for this one, or its int4 layers would compute garbage."""
    if saved_block_rows == int4pack_block_rows():
        return
    for module in model.modules():
        if isinstance(module, Int4Linear):
            n, k = module.out_features, module.in_features
            module.weight = pack_int4(unpack_int4(module.weight, n, k, saved_block_rows))


def load_artifact(
    path: str | Path, dtype: torch.dtype | None, loaded_model: Callable[..., Any], max_rope_positions: int
) -> Any:
    """``loaded_model(model, config, tokenizer, folder, "mcp2026-artifact", formats, file_bytes)`` (the loader's
    LoadedModel) from an artifact folder. ``dtype`` converts the tensors that are not quantized linears
    (embedding, norms, layers kept dense as nn.Linear); quantized layers stay as compiled. RoPE tables cover
    at most ``max_rope_positions``."""
    folder = Path(path)
    metadata = read_metadata(folder)
    raw = dict(metadata["model_config"])
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
    config = ModelConfig(**raw)
    model = _build(config, metadata["layers"])
    try:
        state = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{folder / WEIGHTS_FILE}: cannot read ({error})") from None
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear)
    missing = [k for k in missing if not (tied and k == "lm_head.weight") and not k.startswith("rope.")]
    if missing or unexpected:
        raise ModelLoadError(
            f"{folder}: weights do not match the metadata (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    _repack_int4(model, metadata.get("int4_pack_block_rows", LEGACY_INT4_BLOCK_ROWS))
    max_positions = min(config.max_position_embeddings, max_rope_positions)
    model.init_rope(max_positions)
    if dtype is not None:
        for module in model.modules():
            if not isinstance(module, QuantLinear):
                for t in [*module._parameters.values(), *module._buffers.values()]:
                    if t is not None and t.is_floating_point() and t.dtype != dtype:
                        t.data = t.data.to(dtype)
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_hf_dir(folder)
    formats = Counter(info["spec"]["format"] for info in metadata["layers"].values())
    size = (folder / WEIGHTS_FILE).stat().st_size
    return loaded_model(
        model.eval().requires_grad_(False), config, tokenizer, folder, "mcp2026-artifact", dict(formats), size
    )
