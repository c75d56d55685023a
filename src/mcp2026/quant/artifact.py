"""A compiled model folder: packed quantized weights, the plan and metadata; loads without recalibrating.

Layout: ``mcp2026_artifact.json`` (metadata: source model path and sha256, model config, per-layer spec
and compute dtype, tokenizer source, the calibration settings when the plan or its levels were calibrated), ``model.safetensors`` (the quantized model's state dict: packed
int4/int8 buffers, scales, act scales, and every other tensor as compiled), ``plan.json``,
``dqg_report.json`` (when the DQG chose the plan) and the tokenizer as HF files (tokenizer.json, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from mcp2026.errors import ModelLoadError
from mcp2026.quant.int4_packing import int4pack_block_rows
from mcp2026.quant.plan import QuantPlan, linear_modules
from mcp2026.quant.quant_linear import QuantLinear

METADATA_FILE = "mcp2026_artifact.json"
WEIGHTS_FILE = "model.safetensors"
PLAN_FILE = "plan.json"
REPORT_FILE = "dqg_report.json"
FORMAT = "mcp2026-quantized"
VERSION = 1


def is_artifact(path: str | Path) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


def source_sha256(path: Path) -> str:
    """sha256 of a model file, or of an HF folder's config.json and *.safetensors (in name order)."""
    files = [path] if path.is_file() else [path / "config.json", *sorted(path.glob("*.safetensors"))]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_tokenizer(tokenizer, out: Path) -> list[str]:
    """As HF files ``Tokenizer.from_hf_dir`` reads back (vocabulary, specials, chat template)."""
    if tokenizer is None:
        return []
    tokenizer.backend.save(str(out / "tokenizer.json"))
    token = tokenizer.backend.id_to_token
    eos = list(tokenizer.eos_token_ids)
    config = {
        "bos_token": token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
        "eos_token": token(eos[0]) if eos else None,
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and head.weight is getattr(model, "embed_tokens", head).weight:
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    return {k: v.detach().contiguous() for k, v in state.items()}


def save_artifact(out_dir: str | Path, loaded, result, quant_config=None) -> Path:
    """Write ``loaded.model`` (already quantized as ``result.plan`` says) to ``out_dir``.

    ``loaded``: the LoadedModel it came from; ``result``: a dqg.DQGResult (or a bare QuantPlan).
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not is_artifact(out):
        raise ValueError(f"{out}: exists and is not empty (and not an artifact); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    plan = result if isinstance(result, QuantPlan) else result.plan
    layers = {
        name: {"spec": m.spec.to_dict(), "compute_dtype": _dtype_name(m.compute_dtype)}
        for name, m in linear_modules(model)
        if isinstance(m, QuantLinear)
    }
    save_file(_state_dict(model), str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
    (out / PLAN_FILE).write_text(plan.to_json())
    if not isinstance(result, QuantPlan) and result.layers:
        (out / REPORT_FILE).write_text(result.to_json())
    else:
        (out / REPORT_FILE).unlink(missing_ok=True)  # from an earlier compile into this folder
    source = Path(loaded.source)
    metadata = {
        "format": FORMAT, "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "source": {"path": str(source.resolve()), "sha256": source_sha256(source),
                   "file_format": loaded.file_format, "tensor_formats": loaded.tensor_formats},
        "model_config": dataclasses.asdict(loaded.config),
        "dtype": _dtype_name(model.embed_tokens.weight.dtype),
        "tokenizer": {"source": f"{loaded.file_format}:{source.resolve()}", "files": save_tokenizer(loaded.tokenizer, out)},
        "quant_config": dataclasses.asdict(quant_config) if quant_config is not None else None,
        "calibration": None if isinstance(result, QuantPlan) else result.calibration,
        "plan_id": plan.plan_id,
        "int4_pack_block_rows": int4pack_block_rows(),
        "layers": layers,
    }  # fmt: skip
    (out / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
    return out


def read_metadata(path: str | Path) -> dict:
    file = Path(path) / METADATA_FILE
    try:
        metadata = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{file}: cannot read artifact metadata ({error})") from None
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise ModelLoadError(
            f"{file}: not a {FORMAT} v{VERSION} artifact "
            f"(format={metadata.get('format')!r}, version={metadata.get('version')!r}); recompile it"
        )
    return metadata
