"""Peers measured in the same run as our engine: HF transformers ``generate`` (the native PyTorch baseline,
on the same weights: it loads the same GGUF or HF folder) and llama.cpp through ``llama-cpp-python`` when
installed. Every peer gets the token ids our tokenizer produced, never its own tokenization (PEERS.md:
transformers' GGUF tokenizer splits whitespace and digits differently).

Greedy everywhere, EOS ignored: each request produces exactly the tokens it asks for, on every engine.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcp2026 import hardware
from mcp2026.bench.workloads import BenchRequest
from mcp2026.loading.loader import default_model_path


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message says why and how to enable it."""


@dataclass
class GenerationTiming:
    """One timed generation. ``token_times`` are perf_counter stamps taken as each step's tokens came out
    (one stamp per step, for the whole batch), so decode time = last stamp - first stamp."""

    start: float
    end: float
    token_times: list[float]
    token_ids: list[list[int]] = field(default_factory=list)  # per row, new tokens only

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def num_steps(self) -> int:
        return len(self.token_times)

    @property
    def decode_tokens(self) -> int:
        """Tokens of steps 2..N: every new token but the first step's one (a step that kept draft tokens
        gives several; the first step, the prompt's, samples one)."""
        if not self.token_ids:
            return max(self.num_steps - 1, 0)
        return max(len(self.token_ids[0]) - 1, 0)

    @property
    def decode_seconds(self) -> float:
        """Time of steps 2..N: after the first token (prefill) to the last."""
        return self.token_times[-1] - self.token_times[0] if len(self.token_times) > 1 else 0.0


# ---- HF transformers ------------------------------------------------------------------------------
def load_hf_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same weights our loader reads: the default GGUF, a .gguf file, or an HF folder."""
    from transformers import AutoModelForCausalLM  # heavy (seconds): only runs with the HF peer load it

    source = default_model_path() if model is None else Path(model).expanduser()
    if source.is_file():
        hf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    hf = hf.eval().requires_grad_(False)
    # NOTE: a GenerationConfig passed to generate() is merged with this one, so EOS must be cleared here
    # for generation to run past EOS (our engine's ignore_eos).
    hf.generation_config.eos_token_id = None
    return hf


def load_hf_peer(model: str | Path | None = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``load_hf_model`` for a benchmark: where transformers cannot load the model (an architecture or GGUF
    type it does not know, a missing file) the peer is unavailable, with the reason, and the run goes on."""
    try:
        return load_hf_model(model, dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PeerUnavailable(
            f"HF transformers peer skipped: transformers cannot load this model ({type(e).__name__}: {e})"
        ) from None


def hf_with_dtype(hf: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy in another dtype (loading the GGUF again costs far more than a copy)."""
    return copy.deepcopy(hf).to(dtype)


class _StepClock:
    """A transformers streamer that only timestamps: ``put`` gets the prompt once, then each step's tokens."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def _pad_id(hf: nn.Module) -> int:
    pad = getattr(hf.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else getattr(hf.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def hf_generate(hf: nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int) -> GenerationTiming:
    """Greedy ``generate`` of exactly ``new_tokens`` for every row; prompts left-padded to the longest."""
    from transformers import GenerationConfig  # heavy (seconds): only runs with the HF peer load it

    pad = _pad_id(hf)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    config = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=pad
    )
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock)
    end = time.perf_counter()
    return GenerationTiming(start, end, clock.times, out[:, width:].tolist())


def hf_decode_latency(hf: nn.Module, prompt_ids: Sequence[int], new_tokens: int = 128) -> GenerationTiming:
    """Single stream: ``new_tokens`` greedy tokens after ``prompt_ids``; decode tok/s =
    (new_tokens - 1) / decode_seconds (the first token belongs to prefill)."""
    return hf_generate(hf, [prompt_ids], new_tokens)


def hf_prefill(hf: nn.Module, prompt_ids: Sequence[int]) -> GenerationTiming:
    """Prefill = ``generate`` of one token (the forward over the prompt, logits of its last position, one
    greedy pick); prefill tok/s = len(prompt_ids) / seconds."""
    return hf_generate(hf, [prompt_ids], 1)


@dataclass
class StaticBatchResult:
    """HF static batching over a request list. Counted per request: its own prompt tokens (not padding) and
    its own ``output_len`` tokens. HF generates ``max(output_len)`` of the batch for every row, so
    ``num_generated_tokens`` (rows x batch max) is larger; the excess is the cost of static batching."""

    seconds: float  # sum of the generate() calls' wall time
    records: list[dict[str, Any]]  # per request, in input order
    batches: list[dict[str, Any]]  # per batch: size, padded width, new tokens, seconds, decode seconds
    num_generated_tokens: int


def hf_generate_static_batches(
    hf: nn.Module, requests: Sequence[BenchRequest], batch_size: int = 16, progress: Any = None
) -> StaticBatchResult:
    """Consecutive batches of ``batch_size`` requests in the given order (as vLLM's ``throughput --backend
    hf``), each left-padded, greedy, ``max_new_tokens = max(output_len in the batch)``, EOS ignored."""
    records: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    total, generated = 0.0, 0
    task = (
        progress.add_task("HF static batches", total=sum(r.output_len for r in requests))
        if progress
        else None
    )
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        new_tokens = max(r.output_len for r in batch)
        timing = hf_generate(hf, [r.prompt_token_ids for r in batch], new_tokens)
        total += timing.seconds
        generated += len(batch) * new_tokens
        batches.append(
            {
                "batch": len(batches),
                "size": len(batch),
                "padded_prompt_len": max(r.prompt_len for r in batch),
                "max_new_tokens": new_tokens,
                "seconds": timing.seconds,
                "decode_seconds": timing.decode_seconds,
                "num_steps": timing.num_steps,
            }
        )
        for r in batch:
            records.append(
                {
                    "engine": "hf",
                    "request_id": r.request_id,
                    "prompt_len": r.prompt_len,
                    "output_len": r.output_len,
                    "num_output_tokens": r.output_len,  # counted: its own tokens only
                    "batch": len(batches) - 1,
                    "e2e_s": timing.end - timing.start,
                }
            )
        if progress is not None:
            progress.advance(task, sum(r.output_len for r in batch))
    return StaticBatchResult(total, records, batches, generated)


# ---- llama.cpp ------------------------------------------------------------------------------------
def load_llama_cpp(
    gguf_path: str | Path | None = None,
    n_ctx: int = 2048,
    n_threads: int | None = None,
    logits_all: bool = False,
    **options: Any,
) -> Any:
    """A ``llama_cpp.Llama`` over the same GGUF file (its own quantized kernels: Q4_1 for the default);
    ``logits_all`` keeps every position's logits (``llm.scores``), for perplexity; ``options`` go to
    ``Llama`` as they are (``type_k``, ``flash_attn``, ...), flash attention on unless they say otherwise."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable(
            "llama.cpp peer skipped: llama-cpp-python is not installed "
            '(CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python; builds llama.cpp, ~12 min on 2 cores)'
        )
    try:
        from llama_cpp import Llama  # optional dependency (llama-cpp-python): the peer is skipped without it
    except ImportError as e:  # installed without its own dependencies (diskcache, ...), or a broken build
        raise PeerUnavailable(f"llama.cpp peer skipped: llama_cpp does not import ({e})") from None

    path = Path(gguf_path) if gguf_path is not None else default_model_path()
    if path.suffix != ".gguf":
        raise PeerUnavailable(f"llama.cpp peer skipped: {path} is not a GGUF file")
    threads = n_threads or hardware.usable_cpu_count()
    # llama.cpp's own tools run with flash attention where the backend has it (`-fa auto`: on for the CPU);
    # llama-cpp-python's default is off, which decodes measurably slower.
    options.setdefault("flash_attn", True)
    return Llama(
        str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
        **options,
    )


def llama_cpp_decode_latency(
    llm: Any, prompt_ids: Sequence[int], new_tokens: int = 128, stop_token_ids: Sequence[int] = ()
) -> GenerationTiming:
    """Greedy decode of ``new_tokens`` (fewer where a ``stop_token_ids`` token comes, which is kept)."""
    llm.reset()
    times: list[float] = []
    tokens: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(list(prompt_ids), top_k=1, top_p=1.0, temp=0.0, reset=True):
        times.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) >= new_tokens or int(token) in stop_token_ids:
            break
    return GenerationTiming(start, times[-1], times, [tokens])


def llama_cpp_prefill(llm: Any, prompt_ids: Sequence[int]) -> GenerationTiming:
    """Evaluate the prompt (llama.cpp computes logits of the last position only)."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(list(prompt_ids))
    end = time.perf_counter()
    return GenerationTiming(start, end, [end])
