"""llama.cpp's own KV cache types in ``mcp2026 bench kv``: the same token sequences through llama.cpp (the GGUF
file as stored, via llama-cpp-python) with its K/V cache in f16 and in each of ``types`` (``q8_0``, ``q4_0``:
32-value blocks with an fp16 scale, 8.5 and 4.5 bits per value), every position's logits kept. Each type is
scored against llama.cpp's own f16 cache, as our codecs are against our uncompressed cache: what quantizing
the cache costs in each engine, on the same text, in the same run.

llama.cpp stores a batch's K/V in the cache before its attention reads them (so every read is quantized) and
evaluates 512-token batches; ours prefills 256-token chunks and then 32-token ones. Quantized V needs its flash
attention, so every llama.cpp run here (f16 too) has it on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mcp2026.bench.peers import load_llama_cpp
from mcp2026.bench.quality import QualityAccumulator, QualityResult

# ggml type ids (ggml.h) and bits per stored value (a 32-value block: data + one fp16 scale)
LLAMA_KV_TYPES = {"f16": (1, 16.0), "q8_0": (8, 8.5), "q4_0": (2, 4.5), "q4_1": (3, 5.0), "q5_0": (6, 5.5)}
SCORE_CHUNK = 256  # positions scored at a time (double-precision log-softmax over the vocabulary)


def _logits(llm: Any, tokens: Sequence[int]) -> torch.Tensor:
    """Every position's logits (n, V) of ``tokens`` evaluated from an empty cache."""
    llm.reset()
    llm.eval(list(tokens))
    return torch.from_numpy(llm.scores[: len(tokens)].copy())


def llama_cpp_kv_quality(
    model: str | Path | None, sequences: Sequence[Sequence[int]], prompt_len: int, types: Sequence[str]
) -> dict[str, list[QualityResult]]:
    """Per KV type, one ``QualityResult`` per sequence against llama.cpp's f16 cache. Raises
    ``PeerUnavailable`` where llama-cpp-python is missing."""
    unknown = sorted(set(types) - set(LLAMA_KV_TYPES))
    if unknown:
        raise ValueError(f"unknown llama.cpp KV types {unknown}; available: {', '.join(LLAMA_KV_TYPES)}")
    n_ctx = max(len(tokens) for tokens in sequences)
    llms = {
        kv_type: load_llama_cpp(
            model,
            n_ctx=n_ctx,
            logits_all=True,
            flash_attn=True,
            type_k=LLAMA_KV_TYPES[kv_type][0],
            type_v=LLAMA_KV_TYPES[kv_type][0],
        )
        for kv_type in ("f16", *types)
    }
    out: dict[str, list[QualityResult]] = {t: [] for t in types}
    try:
        for tokens in sequences:
            reference = _logits(llms["f16"], tokens)
            tests = [_logits(llms[t], tokens) for t in types]
            scores = QualityAccumulator(tokens, len(types), prompt_len)
            for start in range(0, len(tokens), SCORE_CHUNK):
                end = start + SCORE_CHUNK
                scores.add(start, reference[start:end], [t[start:end] for t in tests])
            for kv_type, result in zip(types, scores.results()):
                out[kv_type].append(result)
    finally:
        for llm in llms.values():
            llm.close()
    return out


def kv_type_bytes_ratio(kv_type: str) -> float:
    """How many times fewer bytes than bf16 a llama.cpp cache type stores per value."""
    return 16.0 / LLAMA_KV_TYPES[kv_type][1]
