"""Measurements for KV compression (the pieces of ``mcp2026 bench kv``): teacher-forced perplexity and KL
divergence of a long token sequence run through two engines' paged caches in lockstep, KV bytes per token,
how many sequences fit a memory budget, and decode speed at a given context length.

Teacher forcing goes through the real path: block tables, the codec's write and read, and the evictor
after every chunk. The prompt part is computed in ``prompt_chunk``-token chunks; the rest in ``chunk_size``
chunks (1 = token by token, like decoding; larger chunks evict only between chunks).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcp2026.config import EngineConfig, KVConfig, ModelConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.engine.request import Request, RequestStatus
from mcp2026.kv.compressor import KVCompressor
from mcp2026.kv.manager import cdiv
from mcp2026.kv.paged_cache import staging_dtype
from mcp2026.kv.sizing import kv_block_bytes


@dataclass(frozen=True)
class QualityResult:
    num_tokens: int  # predicted tokens scored
    ppl_ref: float
    ppl: float
    kld: float  # mean KL(ref || compressed) per token, nats
    top1_agreement: float  # share of positions where both argmax agree
    # The same perplexities over the positions after the prompt only (what generation sees: a prompt
    # token's own logits are computed while its chunk still reads the uncompressed prompt so far)
    num_tokens_after_prompt: int = 0
    ppl_ref_after_prompt: float = float("nan")
    ppl_after_prompt: float = float("nan")

    @property
    def ppl_increase(self) -> float:
        return self.ppl / self.ppl_ref - 1.0


def _chunks(
    num_tokens: int, prompt_len: int, prompt_chunk: int, chunk_size: int
) -> Iterator[tuple[int, int]]:
    start = 0
    while start < num_tokens:
        size = prompt_chunk if start < prompt_len else chunk_size
        end = (
            min(start + size, num_tokens, prompt_len) if start < prompt_len else min(start + size, num_tokens)
        )
        yield start, end
        start = end


def iter_logits(
    engine: LLMEngine,
    token_ids: Sequence[int],
    prompt_len: int | None = None,
    prompt_chunk: int = 512,
    chunk_size: int = 1,
    request_id: str = "kv-measure",
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start, logits (n, V)) per chunk: the logits of positions start .. start+n-1. The engine must be
    idle; its blocks are freed at the end."""
    if engine.has_unfinished():
        raise ValueError("iter_logits needs an idle engine")
    tokens = [int(t) for t in token_ids]
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    if not 1 <= prompt_len <= len(tokens) or len(tokens) > engine.max_model_len:
        raise ValueError(f"need 1 <= prompt_len <= {len(tokens)} tokens <= {engine.max_model_len}")
    request = Request(request_id, tokens[:prompt_len], output_token_ids=tokens[prompt_len:])
    request.status = RequestStatus.RUNNING
    manager, runner, evictor = engine.kv_manager, engine.runner, engine.evictor
    engine.cache.release_requests([request_id])
    try:
        for start, end in _chunks(len(tokens), prompt_len, prompt_chunk, chunk_size):
            if not manager.allocate_slots(request, end - start):
                raise RuntimeError(f"the KV pool is full at {start} tokens; raise its budget or evict more")
            chunk = ScheduledChunk(
                request_id,
                tokens[start:end],
                start,
                manager.block_table(request_id),
                end == prompt_len,
                manager.num_dropped_tokens(request_id),
            )
            _, logits = runner.execute(SchedulerOutput([chunk], end - start), all_logits=True)
            request.num_computed_tokens = end
            if evictor is not None:
                evictor.after_step(
                    [chunk], runner.take_scores(), lambda _rid: request, engine.lookahead_attention
                )
            yield start, logits
    finally:
        manager.free(request)
        engine.cache.release_requests([request_id])
        if evictor is not None:
            evictor.forget([request_id])
        runner.take_scores()


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
    from mcp2026 import hardware

    model = loaded.config
    dtype = next(loaded.model.parameters()).dtype
    pool = (cdiv(max_tokens, block_size) + 1) * kv_block_bytes(model, block_size, dtype)
    logits = prompt_chunk * model.vocab_size * torch.empty((), dtype=torch.float32).element_size()
    fits = int(memory_share * hardware.available_memory_bytes() // (pool + logits)) - 1
    return max(1, min(num_tests, fits))


def compare_quality(
    ref: LLMEngine,
    test: LLMEngine,
    token_ids: Sequence[int],
    prompt_len: int | None = None,
    prompt_chunk: int = 512,
    chunk_size: int = 1,
) -> QualityResult:
    """Perplexity of both engines and KL(ref || test) on the same teacher-forced sequence."""
    return compare_quality_many(ref, [test], token_ids, prompt_len, prompt_chunk, chunk_size)[0]


class QualityAccumulator:
    """Running sums of several test streams' logits against a reference's on one teacher-forced sequence:
    NLL (over all positions and after the prompt), KL(ref || test) and top-1 agreement. Feed it chunks of
    logits in position order; any engine's logits will do (ours, or a peer's)."""

    def __init__(self, token_ids: Sequence[int], num_tests: int, prompt_len: int | None = None) -> None:
        self.tokens = torch.tensor([int(t) for t in token_ids])
        self.first_after = len(self.tokens) if prompt_len is None else prompt_len  # logits at positions >= it
        self.nll_ref = self.nll_ref_after = 0.0
        self.nll, self.nll_after = [0.0] * num_tests, [0.0] * num_tests
        self.kld, self.agree = [0.0] * num_tests, [0] * num_tests
        self.count = self.count_after = 0

    def add(self, start: int, ref_logits: torch.Tensor, test_logits: Sequence[torch.Tensor]) -> None:
        """Logits (n, V) of positions start .. start + n - 1: the reference's, and each test's."""
        n = min(ref_logits.shape[0], len(self.tokens) - 1 - start)  # the last position has no next token
        if n <= 0:
            return
        target = self.tokens[start + 1 : start + 1 + n].unsqueeze(1)
        after = slice(max(0, self.first_after - start), n)
        la = torch.log_softmax(ref_logits[:n].double(), -1)
        pa, top = la.exp(), la.argmax(-1)
        token_nll = -la.gather(1, target)
        self.nll_ref += float(token_nll.sum())
        self.nll_ref_after += float(token_nll[after].sum())
        for i, b in enumerate(test_logits):
            lb = torch.log_softmax(b[:n].double(), -1)
            token_nll = -lb.gather(1, target)
            self.nll[i] += float(token_nll.sum())
            self.nll_after[i] += float(token_nll[after].sum())
            self.kld[i] += float((pa * (la - lb)).sum())
            self.agree[i] += int((top == lb.argmax(-1)).sum())
        self.count += n
        self.count_after += len(range(n)[after])

    def results(self) -> list[QualityResult]:
        if self.count == 0:
            raise ValueError("need at least 2 tokens")

        def after_ppl(total: float) -> float:
            return math.exp(total / self.count_after) if self.count_after else float("nan")

        ppl_ref = math.exp(self.nll_ref / self.count)
        return [
            QualityResult(
                self.count,
                ppl_ref,
                math.exp(self.nll[i] / self.count),
                self.kld[i] / self.count,
                self.agree[i] / self.count,
                self.count_after,
                after_ppl(self.nll_ref_after),
                after_ppl(self.nll_after[i]),
            )
            for i in range(len(self.nll))
        ]


def compare_quality_many(
    ref: LLMEngine,
    tests: Sequence[LLMEngine],
    token_ids: Sequence[int],
    prompt_len: int | None = None,
    prompt_chunk: int = 512,
    chunk_size: int = 1,
) -> list[QualityResult]:
    """``compare_quality`` for several test engines in one lockstep: the reference runs once, not once per
    test. Memory: every engine holds one chunk of logits (``prompt_chunk`` x vocab floats) at a time."""
    scores = QualityAccumulator(token_ids, len(tests), prompt_len)
    streams = zip(
        iter_logits(ref, token_ids, prompt_len, prompt_chunk, chunk_size, "kv-ref"),
        *(iter_logits(t, token_ids, prompt_len, prompt_chunk, chunk_size, "kv-test") for t in tests),
    )
    for (start, a), *others in streams:
        scores.add(start, a, [b for _, b in others])
    return scores.results()


def kv_bytes_per_token(model: ModelConfig, compressor: KVCompressor | None, dtype: torch.dtype) -> float:
    """Pool bytes per cached token (all layers, K and V), before eviction."""
    codec = compressor.make_codec() if compressor is not None else None
    bs = compressor.block_size if compressor is not None else 16
    return kv_block_bytes(model, bs, dtype, codec) / bs


def bounds_peak(policy: str) -> bool:
    """Whether the policy keeps a sequence within its budget all along: snap compresses the prompt once, and
    a policy that keeps a prompt whole (heavy_hitter) holds all of it while prefilling (a 2048-token prompt)."""
    from mcp2026.kv.eviction import POLICIES

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
    from mcp2026.types import SamplingParams

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
