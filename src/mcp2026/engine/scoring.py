"""Teacher forcing: the logits a model predicts at every position of a known token sequence, computed through
the engine's real path (block tables, the KV codec's write and read, the evictor after every chunk).

Every measurement (perplexity, KL divergence, calibration probes) reads logits this way, through
``LLMEngine.score``. The prompt part runs in ``prompt_chunk``-token chunks, the rest in ``chunk_size`` chunks
(1 = token by token, like decoding; larger chunks evict only between chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.engine.request import Request, RequestStatus


class ScoredChunk(NamedTuple):
    start: int  # position of the first row
    logits: torch.Tensor  # (n, V): the predictions at positions start .. start + n - 1


class ScoringEngine(Protocol):
    """The parts of ``LLMEngine`` teacher forcing drives; the engine must be idle."""

    kv_manager: Any
    runner: Any
    evictor: Any
    cache: Any
    max_model_len: int
    lookahead_attention: Callable[..., Any]

    def has_unfinished(self) -> bool: ...


def chunk_bounds(
    num_tokens: int, prompt_len: int, prompt_chunk: int, chunk_size: int
) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk: ``prompt_chunk`` tokens up to the prompt's end, then ``chunk_size``."""
    start = 0
    while start < num_tokens:
        size = prompt_chunk if start < prompt_len else chunk_size
        end = (
            min(start + size, num_tokens, prompt_len) if start < prompt_len else min(start + size, num_tokens)
        )
        yield start, end
        start = end


def teacher_forced_logits(
    engine: ScoringEngine,
    token_ids: Sequence[int],
    prompt_len: int | None = None,
    prompt_chunk: int = 512,
    chunk_size: int = 1,
    request_id: str = "score",
) -> Iterator[ScoredChunk]:
    """One ``ScoredChunk`` per chunk, in position order; the request's blocks are freed at the end (also
    when the caller stops early)."""
    if engine.has_unfinished():
        raise ValueError("scoring needs an idle engine")
    tokens = [int(t) for t in token_ids]
    prompt_len = len(tokens) if prompt_len is None else prompt_len
    if not 1 <= prompt_len <= len(tokens) or len(tokens) > engine.max_model_len:
        raise ValueError(f"need 1 <= prompt_len <= {len(tokens)} tokens <= {engine.max_model_len}")
    request = Request(request_id, tokens[:prompt_len], output_token_ids=tokens[prompt_len:])
    request.status = RequestStatus.RUNNING
    manager, runner, evictor = engine.kv_manager, engine.runner, engine.evictor
    engine.cache.release_requests([request_id])
    try:
        for start, end in chunk_bounds(len(tokens), prompt_len, prompt_chunk, chunk_size):
            if not manager.allocate_slots(request, end - start):
                raise RuntimeError(f"the KV pool is full at {start} tokens; raise its budget or evict more")
            chunk = ScheduledChunk(
                request_id,
                tokens[start:end],
                start,
                manager.block_table(request_id),
                end == prompt_len,
                kv_offset=manager.num_dropped_tokens(request_id),
            )
            _, logits = runner.execute(SchedulerOutput([chunk], end - start), all_logits=True)
            request.num_computed_tokens = end
            if evictor is not None:
                evictor.after_step(
                    [chunk], runner.take_scores(), lambda _rid: request, engine.lookahead_attention
                )
            yield ScoredChunk(start, logits)
    finally:
        manager.free(request)
        engine.cache.release_requests([request_id])
        if evictor is not None:
            evictor.forget([request_id])
        runner.take_scores()
