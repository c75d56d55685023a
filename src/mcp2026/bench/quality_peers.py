"""Peers in ``mcp2026 bench quality``: HF transformers and llama.cpp score the same held-out windows as our
fp32 reference, and get the same columns (PPL, ΔPPL and KLD against our reference).

HF runs the same weights in fp32: its row checks our reference (ΔPPL ~0, KLD ~0). llama.cpp runs the GGUF
file as stored with its own kernels (for the embedded model, Q4_1 with its quantized activations): its row is
what the file loses in llama.cpp's arithmetic, next to what our quantized plans lose. ``llama.cpp:Q4_K_M`` (any of
``LLAMA_CPP_FILE_TYPES``) runs the file re-quantized by llama.cpp's own quantizer to that type: llama.cpp's formats
at their bits, beside our plans at theirs. Each one is skipped with a line saying why when it cannot run here.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mcp2026.bench.llama_cpp_quantize import LLAMA_CPP_FILE_TYPES, quantize_gguf, weight_bits
from mcp2026.bench.peers import PeerUnavailable, load_hf_peer, load_llama_cpp
from mcp2026.bench.quality import evaluate
from mcp2026.loading.loader import default_model_path
from mcp2026.quant.perplexity import scored_positions

PEERS = ("hf", "llama.cpp", *(f"llama.cpp:{t}" for t in LLAMA_CPP_FILE_TYPES))


@torch.inference_mode()
def hf_scored_logprobs(hf: Any, window: Tensor) -> Tensor:
    """HF's log-probabilities (S, V) at the positions ``quant.perplexity.scored_logprobs`` scores."""
    logits = hf(input_ids=window[None]).logits[0, scored_positions(len(window))]  # (S, V)
    return torch.log_softmax(logits.float(), dim=-1)


def llama_cpp_scored_logprobs(llm: Any, window: Tensor) -> Tensor:
    """llama.cpp's log-probabilities (S, V) at the scored positions (``llm`` built with ``logits_all``)."""
    llm.reset()
    llm.eval(window.tolist())
    logits = torch.from_numpy(llm.scores[scored_positions(len(window))].copy())  # (S, V)
    return torch.log_softmax(logits.float(), dim=-1)


def _hf_row(model: str | Path | None, windows: Sequence[Tensor], reference: Sequence[Tensor]) -> dict:
    hf = load_hf_peer(model, torch.float32)
    return {
        "plan": "HF transformers fp32 (peer)",
        "family": "peer",
        "bits": 32.0,
        "mib": None,
        **evaluate(lambda w: hf_scored_logprobs(hf, w), windows, reference).to_dict(),
    }


def _gguf_path(model: str | Path | None, peer: str) -> Path:
    path = Path(model) if model is not None else default_model_path()
    if path.suffix != ".gguf":
        raise PeerUnavailable(f"{peer} peer skipped: {path} is not a GGUF file")
    return path


def _llama_cpp_scored(path: Path, windows: Sequence[Tensor], reference: Sequence[Tensor]):
    llm = load_llama_cpp(path, n_ctx=max(len(w) for w in windows), logits_all=True)
    try:
        return evaluate(lambda w: llama_cpp_scored_logprobs(llm, w), windows, reference)
    finally:
        llm.close()


def _llama_cpp_row(model: str | Path | None, windows: Sequence[Tensor], reference: Sequence[Tensor]) -> dict:
    path = _gguf_path(model, "llama.cpp")
    result = _llama_cpp_scored(path, windows, reference)
    return {
        "plan": f"llama.cpp, {path.name} as stored (peer)",
        "family": "peer",
        "bits": weight_bits(path),
        "mib": path.stat().st_size / 2**20,
        **result.to_dict(),
    }


def _llama_cpp_quantized_row(
    file_type: str, model: str | Path | None, windows: Sequence[Tensor], reference: Sequence[Tensor]
) -> dict:
    source = _gguf_path(model, f"llama.cpp:{file_type}")
    with tempfile.TemporaryDirectory(prefix="mcp2026-llama-quantize-") as tmp:
        path = quantize_gguf(source, file_type, Path(tmp))
        result = _llama_cpp_scored(path, windows, reference)
        bits, mib = weight_bits(path), path.stat().st_size / 2**20
    return {
        "plan": f"llama.cpp {file_type} (llama.cpp's quantizer on {source.name}; peer)",
        "family": "llama.cpp",
        "bits": bits,
        "mib": mib,
        **result.to_dict(),
    }


def peer_quality_rows(
    model: str | Path | None,
    peers: Sequence[str],
    windows: Sequence[Tensor],
    reference: Sequence[Tensor],
) -> tuple[list[dict], list[str]]:
    """A quality row per peer that runs here, and a line for each one skipped."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown quality peers {unknown}; available: {', '.join(PEERS)}")
    rows, notes = [], []
    runners = {"hf": _hf_row, "llama.cpp": _llama_cpp_row}
    runners |= {f"llama.cpp:{t}": partial(_llama_cpp_quantized_row, t) for t in LLAMA_CPP_FILE_TYPES}
    for peer, row in runners.items():
        if peer not in peers:
            continue
        try:
            rows.append(row(model, windows, reference))
        except PeerUnavailable as e:
            notes.append(str(e))
    return rows, notes
