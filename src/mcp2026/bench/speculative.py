"""Speculative decoding, single stream: decode tok/s with prompt-lookup drafts (our default) beside the same
engine without them and llama.cpp's plain decode of the same GGUF, on two workloads:

- grounded: a ShareGPT answer of 120-300 tokens (evaluation split) given with a task over it (rewrite it
  correcting spelling, summarise it, extract its names, numbers and dates), round robin;
- chat: ShareGPT first user turns (evaluation split), answered freely.

Greedy, each request stops at EOS or ``new_tokens`` on every engine; engines alternate per request (ours without
drafts, ours with, llama.cpp). Decode tok/s of a request = (tokens - 1) / (time of its last token - time of its
first); a workload's figure is its tokens over its decode seconds, summed over its requests. The run also counts
the requests whose tokens with drafts equal those without (exactness on this machine's kernels).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from mcp2026.bench import peers
from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.config import KVConfig, SchedulerConfig, SpeculativeConfig
from mcp2026.pipeline import Pipeline
from mcp2026.sharegpt import conversation_text, load_conversations, sharegpt_path, split_of
from mcp2026.types import SamplingParams

TASKS = (
    "Rewrite the following text with correct spelling and grammar, keeping everything else the same:\n\n",
    "Summarise the following text in a few sentences:\n\n",
    "Extract every name, number and date from the following text as a list:\n\n",
)
WORKLOADS = ("grounded", "chat")
DRAFT_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")  # StepStats' num_* speculation counters


@dataclass(frozen=True)
class SpeculativeBenchConfig:
    model: str | None = None  # None: the embedded default model
    num_grounded: int = 9
    num_chat: int = 6
    new_tokens: int = 128
    num_tokens: int = SpeculativeConfig().num_tokens  # the most draft tokens per step
    peer: bool = True

    def __post_init__(self) -> None:
        if self.new_tokens < 2 or self.num_grounded < 0 or self.num_chat < 0:
            raise ValueError("new_tokens must be >= 2 and the prompt counts >= 0")
        if self.num_grounded + self.num_chat == 0:
            raise ValueError("give at least one grounded or chat prompt")
        SpeculativeConfig(num_tokens=self.num_tokens)  # validates

    def command(self) -> str:
        parts = ["mcp2026 bench speculative"]
        if self.model:
            parts.append(f"--model {self.model}")
        parts += [
            f"--num-grounded {self.num_grounded}",
            f"--num-chat {self.num_chat}",
            f"--new-tokens {self.new_tokens}",
            f"--num-tokens {self.num_tokens}",
        ]
        if not self.peer:
            parts.append("--no-peer")
        return " ".join(parts)


def workload_prompts(pipe: Pipeline, config: SpeculativeBenchConfig) -> list[tuple[str, list[int]]]:
    """(workload, chat-templated prompt ids), grounded ones first; evaluation-split text only."""
    tokenizer = pipe.tokenizer
    grounded, chat = [], []
    for conversation in load_conversations(str(sharegpt_path())):
        if split_of(conversation_text(conversation)) != "evaluation":
            continue
        answer, question = conversation[1].get("value", ""), conversation[0].get("value", "")
        if len(grounded) < config.num_grounded and 120 <= len(tokenizer.encode(answer)) <= 300:
            grounded.append(TASKS[len(grounded) % len(TASKS)] + answer)
        elif len(chat) < config.num_chat and 10 <= len(tokenizer.encode(question)) <= 200:
            chat.append(question)
        if len(grounded) >= config.num_grounded and len(chat) >= config.num_chat:
            break
    return [
        (name, pipe.encode([{"role": "user", "content": text}]))
        for name, texts in (("grounded", grounded), ("chat", chat))
        for text in texts
    ]


def _ours(pipe: Pipeline, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    engine = pipe.engine
    engine.add_request(prompt, SamplingParams(max_tokens=new_tokens))
    times: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter()
            times += [now] * len(o.delta_token_ids)  # a drafted step's tokens all arrive at its end
            tokens = o.output.token_ids
    return list(tokens), times


def _decode_rate(times: list[float]) -> tuple[int, float]:
    """(decode tokens, decode seconds): every token after the first, from the first token's arrival."""
    return len(times) - 1, (times[-1] - times[0]) if len(times) > 1 else 0.0


def run_speculative(config: SpeculativeBenchConfig | None = None, progress: Any = None) -> BenchRun:
    config = config or SpeculativeBenchConfig()
    notes: list[str] = []
    scheduler = SchedulerConfig(max_model_len=1024)
    kv = KVConfig(memory_gb=0.5, enable_prefix_caching=False)  # the same prompt runs on several engines
    spec = SpeculativeConfig(num_tokens=config.num_tokens)
    plain = Pipeline(config.model, kv_config=kv, scheduler=scheduler, speculative="off")
    drafted = Pipeline(config.model, kv_config=kv, scheduler=scheduler, speculative=spec)
    if not drafted.engine.speculation["enabled"]:
        raise ValueError(f"speculative decoding does not run here: {drafted.engine.speculation['reason']}")
    llm = None
    if config.peer:
        try:
            llm = peers.load_llama_cpp(config.model, n_ctx=1024)
        except peers.PeerUnavailable as e:
            notes.append(str(e))
    prompts = workload_prompts(drafted, config)
    eos = tuple(drafted.engine.eos_token_ids)
    task = progress.add_task("speculative", total=len(prompts)) if progress else None
    for pipe in (plain, drafted):  # warm-up: first-call costs
        _ours(pipe, prompts[0][1], 8)
    records = []
    for i, (workload, prompt) in enumerate(prompts):
        before = dict(drafted.engine.stats.speculation())
        runs = {
            "plain": _ours(plain, prompt, config.new_tokens),
            "drafted": _ours(drafted, prompt, config.new_tokens),
        }
        if llm is not None:
            timing = peers.llama_cpp_decode_latency(llm, prompt, config.new_tokens, eos)
            runs["llama.cpp"] = (timing.token_ids[0], timing.token_times)
        after = drafted.engine.stats.speculation()
        counted = {name: after[f"num_{name}"] - before[f"num_{name}"] for name in DRAFT_COUNTERS}
        for engine, (tokens, times) in runs.items():
            n, seconds = _decode_rate(times)
            records.append(
                {
                    "workload": workload,
                    "prompt": i,
                    "prompt_len": len(prompt),
                    "engine": engine,
                    "num_tokens": len(tokens),
                    "decode_tokens": n,
                    "decode_seconds": seconds,
                    "same_as_plain": tokens == runs["plain"][0],
                    **{name: counted[name] if engine == "drafted" else None for name in DRAFT_COUNTERS},
                }
            )
        if progress is not None:
            progress.advance(task)
    aggregates = _aggregate(records)
    # what a decode step cost by the tokens it computed (the drafter's measurements: 1 = a plain decode)
    costs = drafted.engine.drafter.costs.seconds
    aggregates["decode_step_ms_by_tokens"] = {n: costs[n] * 1e3 for n in sorted(costs)}
    notes.append(
        "decode step ms by tokens computed (drafted engine, moving averages): "
        + ", ".join(f"{n}: {ms:.1f}" for n, ms in aggregates["decode_step_ms_by_tokens"].items())
    )
    run = BenchRun(
        kind="speculative",
        command=config.command(),
        config=asdict(config),
        records=records,
        aggregates=aggregates,
        notes=notes,
        machine=machine_info(),
    )
    run.tables = [_table(aggregates, config)]
    return run


def _aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for workload in WORKLOADS:
        rows = [r for r in records if r["workload"] == workload]
        if not rows:
            continue
        entry: dict[str, Any] = {"num_prompts": len({r["prompt"] for r in rows})}
        for engine in ("plain", "drafted", "llama.cpp"):
            mine = [r for r in rows if r["engine"] == engine]
            if not mine:
                continue
            seconds = sum(r["decode_seconds"] for r in mine)
            entry[engine] = {
                "tok_per_s": sum(r["decode_tokens"] for r in mine) / seconds if seconds else float("nan"),
                "mean_tokens": sum(r["num_tokens"] for r in mine) / len(mine),
                "same_as_plain": sum(r["same_as_plain"] for r in mine),
            }
        drafted = [r for r in rows if r["engine"] == "drafted"]
        drafts = sum(r["drafts"] for r in drafted)
        draft_tokens = sum(r["draft_tokens"] for r in drafted)
        accepted = sum(r["accepted_tokens"] for r in drafted)
        entry["acceptance_rate"] = accepted / draft_tokens if draft_tokens else None
        entry["tokens_per_draft"] = 1 + accepted / drafts if drafts else None
        result[workload] = entry
    return result


def _table(aggregates: dict[str, Any], config: SpeculativeBenchConfig) -> Table:
    rows = []
    for workload in (w for w in WORKLOADS if w in aggregates):
        entry = aggregates[workload]
        plain, drafted, peer = entry["plain"], entry["drafted"], entry.get("llama.cpp")
        rows.append(
            [
                workload,
                entry["num_prompts"],
                plain["tok_per_s"],
                drafted["tok_per_s"],
                peer["tok_per_s"] if peer else "—",
                f"{drafted['tok_per_s'] / plain['tok_per_s']:.2f}x",
                f"{drafted['tok_per_s'] / peer['tok_per_s']:.2f}x" if peer else "—",
                "—" if entry["acceptance_rate"] is None else f"{entry['acceptance_rate']:.2f}",
                "—" if entry["tokens_per_draft"] is None else f"{entry['tokens_per_draft']:.2f}",
                f"{drafted['same_as_plain']}/{entry['num_prompts']}",
                f"{plain['mean_tokens']:.0f} / {drafted['mean_tokens']:.0f}"
                + (f" / {peer['mean_tokens']:.0f}" if peer else ""),
            ]
        )
    title = (
        f"Speculative decoding, single stream: greedy decode of up to {config.new_tokens} tokens, prompt-lookup "
        f"drafts of up to {config.num_tokens} tokens"
    )
    columns = [
        "workload",
        "prompts",
        "ours plain tok/s",
        "ours drafted tok/s",
        "llama.cpp tok/s",
        "drafted vs plain",
        "drafted vs llama.cpp",
        "acceptance",
        "tokens per drafted step",
        "same tokens as plain",
        "mean tokens (plain / drafted / llama.cpp)",
    ]
    return Table(title, columns, rows)
