"""Turns sampled tokens into user-visible outputs: incremental text, stop strings, stop tokens, logprobs
(of generated tokens, and of prompt tokens when asked).

Stop strings are checked on the text; while a stop string could still be forming, the tail that might
belong to it is held back from streams so no client ever sees part of a stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mcp2026.engine.request import Request
from mcp2026.engine.sampler import SamplingState, prompt_logprobs
from mcp2026.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from mcp2026.types import CompletionOutput, SamplingParams, TokenLogprob


@dataclass
class RequestOutput:
    """A streaming update for one request: the new part, and whether it is finished."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: CompletionOutput  # cumulative so far
    delta_logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    arrival_time: float = 0.0  # perf_counter seconds
    first_token_time: float | None = None
    finish_time: float | None = None
    detokenize_s: float = 0.0  # summed wall time of its incremental detokenizing so far


@dataclass
class RequestState:
    """Everything the engine keeps per live request beside the scheduler's Request."""

    request: Request
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    num_streamed_chars: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled as the prompt's chunks run
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    detokenize_s: float = 0.0

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def new_detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer | None:
        return None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, prompt_ids)

    def record_prompt_logprobs(self, state: RequestState, start_pos: int, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens that the rows of a chunk starting at ``start_pos`` predict (row i:
        the token at ``start_pos + i + 1``). Positions already recorded (a recompute after preemption) and
        the row past the prompt (it predicts the first output token) are skipped."""
        prompt = state.request.prompt_token_ids
        if state.prompt_logprobs is None:
            state.prompt_logprobs = [None]  # the first prompt token has nothing before it
        first = len(state.prompt_logprobs) - 1 - start_pos  # the first row not recorded yet
        last = min(logits.shape[0], len(prompt) - 1 - start_pos)  # rows predicting prompt tokens
        if first < 0:  # prompt chunks run in order from position 0 (no prefix-cache hits for these requests)
            raise RuntimeError(
                f"prompt logprobs of {state.request.request_id}: positions before {start_pos} never ran"
            )
        if first >= last:
            return
        targets = prompt[start_pos + first + 1 : start_pos + last + 1]
        num_top = state.params.prompt_logprobs or 0
        state.prompt_logprobs += prompt_logprobs(logits[first:last], targets, num_top)

    def append(self, state: RequestState, token_id: int, logprob: TokenLogprob | None) -> str | None:
        """Record one new token (already appended to the request's output ids by the scheduler, a list the
        sampling state shares); return a finish reason if the request must stop now."""
        now = time.perf_counter()
        state.first_token_time = state.first_token_time or now
        state.token_times.append(now)
        if logprob is not None:
            state.logprobs = (state.logprobs or []) + [logprob]
        params = state.params
        num_out = len(state.sampling.output_token_ids)
        is_stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        if is_stop_token and num_out > params.min_tokens:
            return "stop"
        if state.detokenizer is not None:
            t0 = time.perf_counter()
            state.text += state.detokenizer.push(token_id)
            state.detokenize_s += time.perf_counter() - t0
            if params.stop and num_out > params.min_tokens and self._truncate_at_stop(state):
                return "stop"
        if num_out >= params.max_tokens:
            return "length"
        return None

    @staticmethod
    def _truncate_at_stop(state: RequestState) -> bool:
        # Only the new tail can contain a stop string that was not there before.
        window_start = max(0, state.num_streamed_chars - max(len(s) for s in state.params.stop))
        hits = [i for s in state.params.stop if (i := state.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        state.text = state.text[: min(hits)]
        return True

    def make_output(
        self, state: RequestState, num_new_tokens: int, finish_reason: str | None
    ) -> RequestOutput:
        finished = finish_reason is not None
        if finished and state.detokenizer is not None and finish_reason not in ("stop",):
            t0 = time.perf_counter()
            state.text += state.detokenizer.flush()
            state.detokenize_s += time.perf_counter() - t0
        # Hold back a tail that could be the start of a stop string, until it is decided.
        hold = 0 if finished or not state.params.stop else max(len(s) for s in state.params.stop) - 1
        visible = max(state.num_streamed_chars, len(state.text) - hold)
        delta_text = state.text[state.num_streamed_chars : visible]
        state.num_streamed_chars = visible
        token_ids = state.sampling.output_token_ids
        delta_ids = token_ids[len(token_ids) - num_new_tokens :] if num_new_tokens else []
        req = state.request
        output = CompletionOutput(
            text=state.text if finished else state.text[:visible],
            token_ids=list(token_ids),
            finish_reason=finish_reason,
            prompt_token_ids=req.prompt_token_ids,
            logprobs=state.logprobs,
            prompt_logprobs=state.prompt_logprobs,
            error=req.error,
        )
        delta_logprobs = state.logprobs[-num_new_tokens:] if state.logprobs and num_new_tokens else None
        return RequestOutput(
            request_id=req.request_id,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
            finished=finished,
            finish_reason=finish_reason,
            output=output,
            delta_logprobs=delta_logprobs,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            arrival_time=state.arrival_time,
            first_token_time=state.first_token_time,
            finish_time=state.finish_time,
            detokenize_s=state.detokenize_s,
        )
