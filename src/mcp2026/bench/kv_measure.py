"""Measurements for KV compression (the pieces of ``mcp2026 bench kv`` and ``mcp2026 kv calibrate``): engines
sized for one long teacher-forced sequence and how many fit a lockstep pass (their quality: ``bench.quality``),
KV bytes per token, how many sequences fit a memory budget, and decode speed at a given context length.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from mcp2026 import hardware
from mcp2026.config import EngineConfig, KVConfig, ModelConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.kv.compressor import KVCompressor
from mcp2026.kv.eviction import POLICIES
from mcp2026.kv.manager import cdiv
from mcp2026.kv.sizing import kv_block_bytes
from mcp2026.kv.staging import staging_dtype
from mcp2026.types import SamplingParams


def measurement_engine(
    loaded: Any, compressor: KVCompressor | None, max_tokens: int, block_size: int | None
) -> LLMEngine:
    """An engine whose pool holds one ``max_tokens`` sequence (prefix caching off: every run computes), for
    lockstep measurements. Blocks: ``block_size``, else the compressor's, else the default."""
    config = EngineConfig(KVConfig(block_size=block_size), kv_compressor=compressor)
    kv = dataclasses.replace(
        config.resolved_kv, num_blocks=cdiv(max_tokens, config.block_size) + 1, enable_prefix_caching=False
    )
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, dataclasses.replace(config, kv=kv))


LOCKSTEP_MEMORY_SHARE = 0.25  # of available memory, for the engines run in one lockstep


def lockstep_group_size(
    loaded: Any,
    block_size: int,
    max_tokens: int,
    prompt_chunk: int,
    num_tests: int,
    memory_share: float = LOCKSTEP_MEMORY_SHARE,
) -> int:
    """Test engines per lockstep pass: their pools (``max_tokens`` in the model's dtype, the largest) and one
    ``prompt_chunk`` of logits each in ``memory_share`` of available memory; at least 1, at most ``num_tests``."""
    model = loaded.config
    dtype = next(loaded.model.parameters()).dtype
    pool = (cdiv(max_tokens, block_size) + 1) * kv_block_bytes(model, block_size, dtype)
    logits = prompt_chunk * model.vocab_size * torch.empty((), dtype=torch.float32).element_size()
    fits = int(memory_share * hardware.available_memory_bytes() // (pool + logits)) - 1
    return max(1, min(num_tests, fits))


def kv_bytes_per_token(model: ModelConfig, compressor: KVCompressor | None, dtype: torch.dtype) -> float:
    """Pool bytes per cached token (all layers, K and V), before eviction."""
    codec = compressor.make_codec() if compressor is not None else None
    bs = compressor.block_size if compressor is not None else 16
    return kv_block_bytes(model, bs, dtype, codec) / bs


def bounds_peak(policy: str) -> bool:
    """Whether the policy keeps a sequence within its budget all along: snap compresses the prompt once, and
    a policy that keeps a prompt whole (heavy_hitter) holds all of it while prefilling (a 2048-token prompt)."""
    cls = POLICIES[policy]
    return cls.evicts_during_prefill and not cls.defers_prompt


def max_concurrent_sequences(
    model: ModelConfig,
    compressor: KVCompressor | None,
    budget_bytes: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Sequences of ``seq_len`` tokens a KV budget holds at their longest: blocks the eviction budget keeps
    (with a staged codec, plus one 16-bit staging block each)."""
    bs = compressor.block_size if compressor is not None else 16
    codec = compressor.make_codec() if compressor is not None else None
    block_bytes = kv_block_bytes(model, bs, dtype, codec)
    blocks = cdiv(seq_len, bs)
    if compressor is not None and compressor.evicts and bounds_peak(compressor.policy):
        blocks = min(blocks, compressor.budget().num_keep_blocks(seq_len) + 1)  # +1: the block being filled
    per_seq = blocks * block_bytes
    if codec is not None and codec.is_staged:
        elem = torch.empty((), dtype=staging_dtype(dtype)).element_size()
        per_seq += 2 * model.num_layers * bs * model.num_kv_heads * model.head_dim * elem
    return int(budget_bytes // per_seq)


@dataclass(frozen=True)
class ContextSpeeds:
    """Per engine: prefill tok/s of the prompt and decode tok/s after it."""

    prefill: dict[str, float]
    decode: dict[str, float]


def context_speeds(
    engines: dict[str, LLMEngine], context_len: int, num_tokens: int = 32, seed: int = 0
) -> ContextSpeeds:
    """Prefill and decode tok/s of one sequence per engine with the same ``context_len``-token random prompt,
    side by side: the engines take turns, one step each (a prefill chunk, then a decode token; the order
    rotating every round), so a noisy machine slows them alike. Prefill: the prompt's tokens over the summed
    time of the steps until its first output token; decode: 1 / the median step time after it."""
    names = list(engines)

    def rotation(i: int) -> list[str]:  # every round starts one engine later
        return names[i % len(names) :] + names[: i % len(names)]

    requests = {}
    for name, engine in engines.items():
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, engine.model_config.vocab_size, (context_len,), generator=g).tolist()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=num_tokens + 1, ignore_eos=True))
        requests[name] = engine.request_state(rid).request
    prefill = dict.fromkeys(names, 0.0)
    for i in itertools.count():
        waiting = [n for n in rotation(i) if not requests[n].num_output_tokens]
        if not waiting:
            break
        for name in waiting:
            t0 = time.perf_counter()
            engines[name].step()
            prefill[name] += time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(num_tokens):
        for name in rotation(i):
            t0 = time.perf_counter()
            engines[name].step()
            times[name].append(time.perf_counter() - t0)
    return ContextSpeeds(
        {name: context_len / seconds for name, seconds in prefill.items()},
        {name: 1.0 / statistics.median(t) for name, t in times.items()},
    )
