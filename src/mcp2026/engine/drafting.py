"""Draft tokens for speculative decoding, and the decision of how many to draft.

Prompt lookup (n-gram): when the sequence's last n tokens occurred earlier in it (the prompt or the output), the
tokens that followed that occurrence are a guess at what comes next. Input-grounded requests (summarise,
extract, edit a given text) copy long runs of their prompt, so the guesses often hold; free-form chat rarely.

How far to draft is decided per request and step: a step that computes ``B + k`` tokens instead of ``B`` costs
more (measured here, per step size, on the engine's own decode steps), and k drafts with per-token acceptance
``a`` yield ``(1 - a^(k+1)) / (1 - a)`` tokens. A request drafts the k that maximises tokens per unit of cost,
and none when no k pays. ``a`` is the request's recent acceptance; while it does not draft, it drifts back to
the prior, so a request that stopped drafting tries again later (text may turn to copying).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mcp2026.config import SpeculativeConfig
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput

# Acceptance of a request with no history yet: a request whose text repeats an n-gram is presumed to copy
# until its drafts say otherwise (few do on free-form text, and a rejected draft costs less than a step).
PRIOR_ACCEPTANCE = 0.8
# Weight of the newest draft in a request's acceptance (about the last 4 drafts count).
ACCEPTANCE_DECAY = 0.75
# Per step without a draft, the acceptance moves this share of the way back to the prior.
RECOVERY = 0.05
# Until a step size has been measured, each extra token is assumed to cost this share of a plain step: the
# first drafts explore; measured costs replace it after one step of that size.
PRIOR_TOKEN_COST = 0.25
# Weight of the newest measurement in a step size's cost.
COST_DECAY = 0.9


class NgramIndex:
    """Where each n-gram (``min_n <= n <= max_n``) of a growing token sequence last ended, updated as the
    sequence grows. ``propose`` looks up the sequence's own suffix among the n-grams that end before it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams ending at positions < this are in _ends

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix that has one."""
        length = len(tokens)
        self._index(tokens, length - 1)  # every n-gram ending before the suffix's end
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[length - n :]))
            if end is not None:
                return list(tokens[end : min(end + k, length)])
        return []

    def _index(self, tokens: Sequence[int], upto: int) -> None:
        for end in range(max(self._indexed, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, upto + 1)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields with ``k`` drafts, each kept with probability ``acceptance`` given the ones before:
    1 + a + a^2 + ... + a^k (the sampler's own token always comes)."""
    return sum(acceptance**i for i in range(k + 1))


@dataclass
class StepCosts:
    """Seconds of the engine's decode steps by the number of tokens they computed (moving averages)."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else COST_DECAY * old + (1 - COST_DECAY) * seconds

    def ratio(self, num_tokens: int, base: int) -> float:
        """Cost of a step of ``num_tokens`` over one of ``base`` tokens (>= 1): measured where both were seen,
        else from the nearest measured size below plus the prior cost per extra token."""
        if num_tokens <= base:
            return 1.0
        base_s = self.seconds.get(base)
        if base_s is None:
            return 1.0 + PRIOR_TOKEN_COST * (num_tokens - base)
        measured = self.seconds.get(num_tokens)
        if measured is not None:
            return max(measured / base_s, 1.0)
        below = max(n for n in self.seconds if n < num_tokens and n >= base)
        return self.seconds[below] / base_s + PRIOR_TOKEN_COST * (num_tokens - below)


@dataclass
class _RequestDrafts:
    index: NgramIndex
    acceptance: float = PRIOR_ACCEPTANCE


class Drafter:
    """Proposes draft tokens per request and learns from how many the sampler kept."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.costs = StepCosts()
        self._requests: dict[str, _RequestDrafts] = {}

    def propose(
        self, request_id: str, tokens: Sequence[int], max_tokens: int, num_decoding: int
    ) -> list[int]:
        """Draft tokens for the request whose known tokens are ``tokens`` (its next token to compute is the
        last one), at most ``max_tokens``, in a step decoding ``num_decoding`` requests; [] when drafting does
        not pay."""
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestDrafts(
                NgramIndex(self.config.min_ngram, self.config.max_ngram)
            )
        limit = min(self.config.num_tokens, max_tokens)
        guess = state.index.propose(tokens, limit) if limit > 0 else []
        k = self._best_length(state.acceptance, len(guess), num_decoding)
        if k == 0:
            state.acceptance += RECOVERY * (PRIOR_ACCEPTANCE - state.acceptance)
        return guess[:k]

    def _best_length(self, acceptance: float, available: int, num_decoding: int) -> int:
        best_k, best_rate = 0, 1.0
        for k in range(1, available + 1):
            rate = expected_tokens(acceptance, k) / self.costs.ratio(num_decoding + k, num_decoding)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """The sampler kept the first ``num_accepted`` of the request's ``num_drafted`` draft tokens."""
        state = self._requests.get(request_id)
        if state is None:
            return
        # a draft is a run: token i is only tried when 0..i-1 held, so the per-token rate is accepted / tried
        tried = min(num_accepted + 1, num_drafted)
        rate = num_accepted / tried
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * rate

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step (no prompt chunk) that computed ``num_tokens`` tokens took ``seconds``."""
        self.costs.observe(num_tokens, seconds)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)


# why an engine whose decode steps replay CUDA graphs does not draft
DRAFTS_LEAVE_GRAPHS = (
    "decode steps replay CUDA graphs of one token per sequence, and a drafted step would run eagerly, costing "
    "many graph steps (EngineConfig.cuda_graph_max_batch=0 drafts without graphs)"
)


def speculation_blocker(config: SpeculativeConfig, evictor: Any, cache: Any) -> str | None:
    """Why drafts cannot run with this engine's KV cache (None: they can). A rejected draft's KV is left in its
    slots to be overwritten; an evictor would rank it and a staged codec would quantize it."""
    if not config.enabled:
        return "speculative decoding is off (SpeculativeConfig.method='off')"
    if evictor is not None:
        return "KV eviction is on: drafted KV would be ranked and kept or dropped as if it were real"
    if cache.codec.is_staged:
        return f"the KV codec {cache.codec.name} stages block tails: a rejected draft would be committed"
    return None


def split_draft_rows(
    out: SchedulerOutput, sample_ids: list[str], logits: torch.Tensor
) -> tuple[torch.Tensor, dict[str, tuple[list[int], torch.Tensor]]]:
    """The runner's rows, ``num_sample_rows`` per sampled request, as one row per request (what the batch
    samples first) and, per drafted request, its drafts with the rows after each of them (sampled only as far
    as the drafts hold). Failed requests are not among ``sample_ids``."""
    drafts = {c.request_id: c.token_ids[1:] for c in out.chunks if c.num_draft_tokens and c.samples}
    if not drafts or not sample_ids:
        return logits, {}
    first, rest, row = [], {}, 0
    for rid in sample_ids:
        first.append(row)
        k = len(drafts.get(rid, ()))
        if k:
            rest[rid] = (drafts[rid], logits[row + 1 : row + 1 + k])
        row += 1 + k
    return logits[torch.tensor(first, device=logits.device)], rest


def draft_rows(chunk: ScheduledChunk) -> list[ScheduledChunk]:
    """A drafted chunk as one decode row per token, each attending to the positions up to its own: the rows
    write their K/V before any reads in each layer, so row i sees rows < i. They run in the batched decode
    kernels, which cost less than a chunk's prefill path at these sizes and compute each row as plain decoding
    would (a rejected draft changes no kept token's numbers). Unstaged codecs only: a staged tail is one per
    request (the engine turns drafting off for those)."""
    return [
        ScheduledChunk(
            chunk.request_id,
            [token],
            chunk.start_pos + i,
            chunk.block_table,
            True,
            kv_offset=chunk.kv_offset,
        )
        for i, token in enumerate(chunk.token_ids)
    ]
