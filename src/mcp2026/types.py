"""User-facing value types: sampling parameters and the results of inference."""

from __future__ import annotations

import json as _json  # the field StructuredOutputs.json shadows the module name
import math
from dataclasses import dataclass, field
from typing import Any


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok or (isinstance(value, float) and math.isnan(value)):
        bracket = "(" if low_open else "["
        raise ValueError(f"SamplingParams.{name} must be in {bracket}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate; exactly one field is set (vLLM's ``structured_outputs``).

    ``json`` is a JSON schema (a dict is serialized to a string, so the params stay hashable and the compiled
    grammar can be cached by it); ``json_object`` is any JSON object; ``regex`` a regular expression; ``grammar`` an
    EBNF (GBNF) grammar; ``choice`` one of a few fixed strings.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("StructuredOutputs.choice must be a non-empty list of non-empty strings")
        kinds = [self.json is not None, self.json_object, self.regex is not None, self.grammar is not None]
        if sum(kinds) + (self.choice is not None) != 1:
            raise ValueError(
                "StructuredOutputs takes exactly one of json, json_object, regex, grammar, choice"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    Penalties follow OpenAI/vLLM semantics: presence and frequency penalties are subtracted from the logits
    of tokens already generated; the repetition penalty (CTRL-style, 1.0 = off) divides positive logits and
    multiplies negative ones of tokens seen in prompt or output.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = only the sampled token's
    # top-n logprobs of each prompt token given the ones before (the first has none); 0 = only its own.
    # Every prompt token is computed (no prefix-cache reuse) so that each has its logits.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None  # a grammar every generated token must follow
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias; a dict is accepted)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"SamplingParams.logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(
                f"SamplingParams.prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}"
            )
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("SamplingParams.stop must be non-empty strings")
        if len(self.stop) > 16:
            raise ValueError(f"SamplingParams.stop takes at most 16 strings, got {len(self.stop)}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            # The grammar ends the output with an end-of-sequence token; both options would forbid it.
            raise ValueError(
                "SamplingParams.structured_outputs cannot be combined with ignore_eos or min_tokens"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGIT_BIAS_TOKENS = 1024


def _logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` or ``[(token_id, bias), ...]`` as sorted pairs; ids >= 0, biases in [-100, 100]
    (OpenAI's range: -100 bans a token, 100 all but forces it)."""
    items = bias.items() if isinstance(bias, dict) else bias
    pairs: dict[int, float] = {}
    for token_id, value in items:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids >= 0, got {token_id!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100.0 <= value <= 100.0:
            raise ValueError(f"SamplingParams.logit_bias values must be in [-100, 100], got {value!r}")
        pairs[token_id] = float(value)
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(
            f"SamplingParams.logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}"
        )
    return tuple(sorted(pairs.items()))


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # top-n alternatives: token id -> logprob


@dataclass
class CompletionOutput:
    """One finished (or streaming) generation."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token given the ones before (the first: None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


@dataclass
class InferResult:
    """What ``Pipeline.infer`` returns. Profile fields are filled only with ``profile=True``."""

    outputs: list[CompletionOutput]
    latency_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens_per_s: float | None = None
    peak_rss_bytes: int | None = None
    mem_saturation: float | None = None  # peak fraction of the KV memory budget in use
    mem_bw_util: float | None = None  # decode bytes/s over the machine's measured peak read bandwidth
    breakdown: dict[str, float] = field(default_factory=dict)  # ms per phase
    # bytes: weights, kv_pool_reserved, kv_peak_in_use, activations_and_runtime (peak RSS less the others)
    memory: dict[str, int] = field(default_factory=dict)
    # speculative decoding: enabled (or why not), settings, drafts, acceptance rate, tokens per drafted step
    speculation: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""


POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class EmbeddingParams:
    """How hidden states become one vector per input: the final (normed) hidden states of the input's last
    token (``pooling="last"``, what a decoder LLM's last position summarises) or their mean over the input's
    tokens; then the first ``dimensions`` of it (None: all), L2-normalised unless ``normalize`` is False."""

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"EmbeddingParams.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"EmbeddingParams.normalize must be True or False, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(
                f"EmbeddingParams.dimensions must be an integer >= 1 or None, got {self.dimensions!r}"
            )


@dataclass
class EmbeddingResult:
    """What ``Pipeline.embed`` returns: one vector per input, in input order, and the tokens each input had."""

    embeddings: list[list[float]]
    num_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)
