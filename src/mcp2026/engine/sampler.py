"""Batched token sampler: penalties, min_tokens, temperature, min-p / top-k / top-p, seeded sampling, logprobs.

Each row of the logits belongs to one request, whose ``SamplingState`` (kept by the engine across steps)
holds its own ``torch.Generator``. A random row draws one uniform from that generator per step and picks the
token whose interval of the cumulative distribution holds it (inverse-CDF sampling), so a seeded request gets
the same tokens whether it runs alone or in any batch. Greedy rows never touch the generator.

Order per row: repetition penalty (CTRL) -> frequency/presence penalties -> logit bias -> min_tokens stop mask ->
grammar mask ->
[logprobs are taken here] -> temperature -> min-p -> top-k -> top-p (on the renormalised top-k) -> sample.
Logprobs are the log_softmax of the logits *after* penalties, bias and the masks but *before*
temperature and truncation: the model's (penalised) distribution at temperature 1, whatever the request's
sampling settings, like vLLM's default of reporting unprocessed rather than truncated logprobs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from mcp2026.engine.structured import GrammarMatcher, allocate_bitmask, unpack_bitmask
from mcp2026.types import SamplingParams, TokenLogprob

# NOTE: top-p without top-k first looks at this many most likely tokens (a cheap topk); only rows whose
# nucleus is larger fall back to a full O(V log V) sort. The result is the same either way.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingState:
    """Per-request sampling state. The engine appends each generated token to ``output_token_ids``.

    ``output_token_ids`` is append-only (truncating it is detected; rewriting tokens in place is not).
    ``generator`` is created once per request (seeded from ``params.seed`` if given) on the device of the
    logits; ``eos_token_ids`` are masked, with ``stop_token_ids``, until ``min_tokens`` tokens exist
    (eos is not masked when ``ignore_eos``, since it does not stop the request then). ``grammar`` reads
    ``output_token_ids`` to catch up before each mask.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    grammar: GrammarMatcher | None = None  # structured output: the tokens allowed next
    _prompt_ids: Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _output_counts: Counter[int] = field(default_factory=Counter, init=False, repr=False, compare=False)
    _num_counted: int = field(default=0, init=False, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: tuple[int, ...] = (),
        device: torch.device | str = "cpu",
    ) -> SamplingState:
        generator = torch.Generator(device=device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        return cls(params, list(prompt_token_ids), generator, eos_token_ids=tuple(eos_token_ids))

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """Token ids to mask this step (empty once ``min_tokens`` outputs exist)."""
        p = self.params
        if len(self.output_token_ids) >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys(eos + p.stop_token_ids))

    def prompt_ids_tensor(self, device: torch.device) -> Tensor:
        """Unique prompt token ids, converted once per request (the prompt does not change)."""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = sorted(set(self.prompt_token_ids))
            self._prompt_ids = torch.tensor(ids, dtype=torch.long, device=device)
        return self._prompt_ids

    def output_counts(self) -> Counter[int]:
        """Occurrences of each output token, updated incrementally from the newly appended tokens."""
        if len(self.output_token_ids) < self._num_counted:
            self._output_counts, self._num_counted = Counter(), 0
        self._output_counts.update(self.output_token_ids[self._num_counted :])
        self._num_counted = len(self.output_token_ids)
        return self._output_counts


class SampleOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None for rows whose params.logprobs is None


class Sampler:
    """Picks one token per row. Stateless: everything per request lives in ``SamplingState``."""

    def sample(self, logits: Tensor, states: list[SamplingState]) -> SampleOutput:
        """``logits``: (N, V) float, row i belongs to ``states[i]``. ``logits`` is not modified."""
        num_rows = logits.shape[0]
        if num_rows != len(states):
            raise ValueError(f"got {num_rows} logit rows for {len(states)} sampling states")
        if all(_is_plain_greedy(s) for s in states):
            return SampleOutput(greedy_ids(logits), [None] * num_rows)

        logits = self.process_logits(logits, states)
        token_ids = logits.argmax(dim=-1)  # (N,) right for greedy rows; random rows are overwritten
        random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids[rows] = _sample_random(logits[rows], [states[i] for i in random_rows])
        token_list = token_ids.tolist()
        return SampleOutput(token_list, _logprobs(logits, token_ids, token_list, states))

    def process_logits(self, logits: Tensor, states: list[SamplingState]) -> Tensor:
        """Penalties, logit bias, the min_tokens mask and the grammar mask, applied to a copy. Logprobs
        report these."""
        penalty_rows = [i for i, s in enumerate(states) if s.has_penalties]
        bias_rows = [i for i, s in enumerate(states) if s.params.logit_bias]
        masks = [(i, s.min_tokens_stop_ids) for i, s in enumerate(states)]
        masks = [(i, ids) for i, ids in masks if ids]
        grammar_rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if not penalty_rows and not bias_rows and not masks and not grammar_rows:
            return logits
        logits = logits.to(torch.float32, copy=True)
        if penalty_rows:
            rows = torch.tensor(penalty_rows, device=logits.device)
            logits[rows] = _apply_penalties(logits[rows], [states[i] for i in penalty_rows])
        if bias_rows:
            pairs = [(i, t, b) for i in bias_rows for t, b in states[i].params.logit_bias]
            row_ids, col_ids, biases = (list(column) for column in zip(*pairs, strict=True))
            logits[row_ids, col_ids] += torch.tensor(biases, device=logits.device)
        if masks:
            row_ids = [i for i, ids in masks for _ in ids]
            col_ids = [t for _, ids in masks for t in ids]
            logits[row_ids, col_ids] = float("-inf")
        if grammar_rows:
            vocab = logits.shape[1]
            bitmask = allocate_bitmask(len(grammar_rows), vocab)  # (g, ceil(V / 32)) int32
            for j, i in enumerate(grammar_rows):
                states[i].grammar.fill_mask(states[i].output_token_ids, bitmask, j)
            allowed = unpack_bitmask(bitmask, vocab).to(logits.device)  # (g, V) bool
            rows = torch.tensor(grammar_rows, device=logits.device)
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits


def greedy_ids(logits: Tensor) -> list[int]:
    """Each row's first maximum (a NaN counts as the maximum), as ``argmax``. On the CPU through numpy: its
    argmax is one SIMD pass on the calling thread, where torch's is several times slower over a vocabulary-sized
    row, a visible share of a small model's decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _is_plain_greedy(state: SamplingState) -> bool:
    p = state.params
    return (
        p.is_greedy
        and p.logprobs is None
        and state.grammar is None
        and not state.has_penalties
        and not p.logit_bias
        and not state.min_tokens_stop_ids
    )


def _apply_penalties(logits: Tensor, states: list[SamplingState]) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output only). logits: (n, V).

    Sparse: gathers and scatters only the penalised token ids. Column V of the scratch copy absorbs padding.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    work = logits.new_zeros(num_rows, vocab + 1)
    work[:, :vocab] = logits
    counts = [s.output_counts() for s in states]

    def column(values: list[float]) -> Tensor:
        return torch.tensor(values, dtype=work.dtype, device=device)[:, None]  # (n, 1)

    rep = [s.params.repetition_penalty for s in states]
    if any(r != 1.0 for r in rep):
        seen = [
            torch.cat([s.prompt_ids_tensor(device), torch.tensor(list(c), dtype=torch.long, device=device)])
            for s, c in zip(states, counts, strict=True)
        ]  # a token in both prompt and output appears twice: both writes store the same value
        seen_ids = torch.nn.utils.rnn.pad_sequence(seen, batch_first=True, padding_value=vocab)  # (n, Ls)
        values = work.gather(1, seen_ids)
        r = column(rep)
        work.scatter_(1, seen_ids, torch.where(values > 0, values / r, values * r))

    if any(s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0 for s in states):
        width = max(1, max(len(c) for c in counts))
        output_ids = torch.tensor(
            [list(c) + [vocab] * (width - len(c)) for c in counts], dtype=torch.long, device=device
        )  # (n, Lu) unique output ids
        num_seen = torch.tensor(
            [[*c.values()] + [0] * (width - len(c)) for c in counts], dtype=work.dtype, device=device
        )  # (n, Lu) occurrences of each id, 0 for padding
        freq = column([s.params.frequency_penalty for s in states])
        presence = column([s.params.presence_penalty for s in states])
        values = work.gather(1, output_ids)
        work.scatter_(1, output_ids, values - (freq * num_seen + presence * (num_seen > 0)))
    return work[:, :vocab]


def _sample_random(logits: Tensor, states: list[SamplingState]) -> Tensor:
    """Temperature, min-p, top-k, top-p, then one draw per row from its own generator. Returns (n,)."""
    logits = logits.float()
    vocab = logits.shape[1]
    # Subtracting the row max first keeps tiny temperatures finite (max -> 0, the rest -> -inf at worst).
    temperature = torch.tensor([s.params.temperature for s in states], device=logits.device)[:, None]
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temperature  # (n, V), row max == 0

    min_p = [s.params.min_p for s in states]
    if any(m > 0 for m in min_p):
        # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p), and x_max == 0 here; log(0) = -inf keeps all.
        x = x.masked_fill(x < torch.tensor(min_p, device=x.device).log()[:, None], float("-inf"))

    trunc_rows = [i for i, s in enumerate(states) if 0 < s.params.top_k < vocab or s.params.top_p < 1.0]
    if trunc_rows:
        x = _truncate(x, [states[i].params for i in trunc_rows], trunc_rows)

    weights = x.exp_()  # unnormalised probs (row max 1); x is always a fresh tensor here
    # Inverse-CDF draw with one uniform per row: a row's draw depends only on its own values and generator
    # (any batch gives a seeded request the same tokens), and a 262k vocabulary costs one cumulative sum, not
    # V random numbers. Float64 sums keep the tail's intervals exact enough at that size.
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # (n, V)
    u = torch.empty(len(states), 1, dtype=torch.float64, device=cdf.device)
    for i, state in enumerate(states):
        gen = state.generator
        u[i] = torch.rand(1, generator=gen, dtype=torch.float64, device=gen.device).to(cdf.device)
    # tokens of zero weight have empty intervals: searching to the right never lands on them
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return picked.squeeze(1).clamp_(max=vocab - 1)


def _truncate(x: Tensor, params: list[SamplingParams], row_ids: list[int]) -> Tensor:
    """Top-k then top-p on the given rows of x (n, V); every other token of those rows becomes -inf.

    Rows are grouped by k so that each row's arithmetic depends only on its own values and k, never on
    the other rows in the batch (reproducibility).
    """
    x = x.clone()
    vocab = x.shape[1]
    groups: dict[int, list[int]] = {}
    for j, p in enumerate(params):
        groups.setdefault(p.top_k if 0 < p.top_k < vocab else vocab, []).append(j)
    for k, group in groups.items():
        rows = [row_ids[j] for j in group]
        top_p = torch.tensor([params[j].top_p for j in group], device=x.device)[:, None]  # (g, 1)
        candidates = x[rows]  # (g, V)
        if k < vocab:
            values, indices = candidates.topk(k, dim=-1)  # (g, k), sorted descending
            x[rows] = _nucleus(values, indices, values.logsumexp(dim=-1, keepdim=True), top_p, vocab)[0]
            continue
        log_total = candidates.logsumexp(dim=-1, keepdim=True)  # (g, 1)
        if vocab > _TOP_P_CANDIDATES:
            values, indices = candidates.topk(_TOP_P_CANDIDATES, dim=-1)
            x[rows], covered = _nucleus(values, indices, log_total, top_p, vocab)
            missing = (~covered).nonzero().squeeze(-1)  # (m,) rows whose nucleus is larger
            if len(missing) == 0:
                continue
            rows = [rows[m] for m in missing.tolist()]
            candidates, log_total, top_p = candidates[missing], log_total[missing], top_p[missing]
        values, indices = candidates.sort(dim=-1, descending=True)  # (g, V)
        x[rows] = _nucleus(values, indices, log_total, top_p, vocab)[0]
    return x


def _nucleus(
    values: Tensor, indices: Tensor, log_total: Tensor, top_p: Tensor, vocab: int
) -> tuple[Tensor, Tensor]:
    """Keep the most likely sorted candidates until their mass reaches top_p (all of them if top_p == 1).

    values, indices: (g, c) sorted descending; log_total: (g, 1) log of the normaliser. Returns the
    full (g, V) rows with everything else -inf, and whether the candidates reached top_p, (g,) bool.
    """
    probs = (values - log_total).exp()
    mass = probs.cumsum(dim=-1)
    values = values.masked_fill((mass - probs >= top_p) & (top_p < 1.0), float("-inf"))
    rows = torch.full((values.shape[0], vocab), float("-inf"), device=values.device)
    return rows.scatter_(1, indices, values), mass[:, -1] >= top_p[:, 0]


def _logprobs(
    logits: Tensor, token_ids: Tensor, token_list: list[int], states: list[SamplingState]
) -> list[TokenLogprob | None]:
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(states)
    if not rows:
        return result
    if len(rows) < len(states):
        index = torch.tensor(rows, device=logits.device)
        logits, token_ids = logits[index], token_ids[index]
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (r, V)
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    num_top = min(logits.shape[1], max(states[i].params.logprobs or 0 for i in rows))
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # (r, num_top), sorted descending
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = states[i].params.logprobs or 0
        top = {t: v for t, v in zip(top_ids[j][:n], top_values[j][:n], strict=True) if v != float("-inf")}
        result[i] = TokenLogprob(token_list[i], sampled[j], top)
    return result


def prompt_logprobs(logits: Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    """The logprob of each target token under its row of ``logits`` (n, V), with the ``num_top`` most
    likely alternatives: row i predicts ``targets[i]``. The model's own distribution (no penalty or mask
    applies to a prompt)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, device=logits.device)[:, None]
    own = logprobs.gather(1, index).squeeze(1).tolist()
    if num_top:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(min(num_top, logits.shape[1]), dim=-1))
    else:
        top_values = top_ids = [[] for _ in targets]
    return [
        TokenLogprob(t, v, dict(zip(ids, values, strict=True)))
        for t, v, ids, values in zip(targets, own, top_ids, top_values, strict=True)
    ]
