"""LLMEngine: continuous batching over the paged KV cache. ``step()`` = schedule -> run -> sample -> update.

A failure while running one request fails that request only: the step is retried chunk by chunk to find
the culprit, which finishes with an error and frees its blocks, while every other request keeps running.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from mcp2026 import hardware
from mcp2026.config import EngineConfig, KVConfig, ModelConfig
from mcp2026.engine.drafting import DRAFTS_LEAVE_GRAPHS, Drafter, speculation_blocker, split_draft_rows
from mcp2026.engine.embedding import Embedder
from mcp2026.engine.fault_isolation import FaultHook, execute_isolating, without_failed
from mcp2026.engine.kv_setup import build_engine_kv
from mcp2026.engine.lookahead import draft_attention
from mcp2026.engine.output import SchedulerOutput
from mcp2026.engine.output_processor import OutputProcessor, RequestOutput, RequestState
from mcp2026.engine.request import Request, RequestStatus
from mcp2026.engine.runner import ModelRunner
from mcp2026.engine.sampler import Sampler, SamplingState
from mcp2026.engine.scheduler import Scheduler
from mcp2026.engine.scoring import ScoredChunk, teacher_forced_logits
from mcp2026.engine.step_timer import StepStats, StepTimer
from mcp2026.engine.structured import GrammarCompiler
from mcp2026.engine.weight_pages import place_weights_in_huge_pages
from mcp2026.kv.debug import fragmentation_report
from mcp2026.kv.dtss import DTSSController
from mcp2026.types import CompletionOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    num_failed_requests: int = 0
    num_finished_requests: int = 0
    errors: list[str] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        tokenizer: object | None,
        config: EngineConfig | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.model_config = model_config
        self.tokenizer = tokenizer
        first_param = next(model.parameters())
        dtype = kv_dtype or first_param.dtype
        self.kv_dtype = kv_dtype
        self.device = first_param.device
        if self.device.type == "cpu":
            hardware.cap_cpu_threads()
            place_weights_in_huge_pages(model)  # before the runner's kernels take the weights' addresses
        kv = build_engine_kv(self.config, model_config, model.max_positions, dtype, self.device)
        self.config, self.max_model_len = kv.config, kv.max_model_len
        self.cache, self.kv_manager, self.evictor = kv.cache, kv.manager, kv.evictor
        # why speculative decoding is off (None: it runs); its drafts, if on
        self.speculation_blocker = speculation_blocker(self.config.speculative, self.evictor, self.cache)
        self.drafter = Drafter(self.config.speculative) if self.speculation_blocker is None else None
        self.scheduler = Scheduler(
            self.config.scheduler,
            self.kv_manager,
            self.max_model_len,
            self._peak_blocks_rule(),
            self._propose_drafts if self.drafter is not None else None,
        )
        self._release_window = kv.release_window
        self.runner = ModelRunner(
            model,
            self.cache,
            self.evictor.scoring if self.evictor else None,
            self.evictor.layer_pages if self.evictor else None,
        )
        self.sampler = Sampler()
        self.embedder = Embedder(
            model,
            tokenizer,
            self.max_model_len,
            model_config.vocab_size,
            self.config.scheduler.max_num_batched_tokens,
        )
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or model_config.eos_token_ids)
        self.eos_token_ids = eos
        self.outputs = OutputProcessor(tokenizer, eos)
        self.states: dict[str, RequestState] = {}
        self.stats = StepStats()
        self.timer = StepTimer(
            self.stats, self.scheduler.observe_prefill, self.drafter.observe_step if self.drafter else None
        )
        if self.device.type == "cuda" and self.config.cuda_graph_max_batch:
            max_batch = min(self.config.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)
            self.use_decode_graphs(max_batch)
        self.counters = EngineCounters()
        self.fault_hook: FaultHook | None = None  # tests inject failures here
        self.dtss = self._make_dtss(self.config.resolved_kv)
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # the server builds it from a worker thread, steps use it

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        ttft_deadline: float | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; raises ValueError (prompt too long, empty, bad token ids) before queueing.
        ``arrival_time`` (``time.monotonic`` clock; default now) is when the request reached the caller: the
        scheduling policies order by it, so a request queued behind a running step keeps its place."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(
                f"prompt token ids must be in [0, {vocab}), got {min(token_ids)}..{max(token_ids)}"
            )
        named = [*params.stop_token_ids, *(t for t, _ in params.logit_bias)]
        if named and max(named) >= vocab:
            raise ValueError(f"stop_token_ids and logit_bias take token ids < the vocabulary size {vocab}")
        if len(token_ids) + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but this model's context is {self.max_model_len} tokens "
                "(prompt + at least 1 generated token); shorten the prompt"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            priority=priority,
            ttft_deadline=ttft_deadline,
            cache_salt=cache_salt,
            tenant=tenant,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        grammar = None
        if (
            params.structured_outputs is not None
        ):  # compiled (or a cache hit) before queueing: errors are the caller's
            grammar = self.grammar_compiler().matcher(params.structured_outputs, self.eos_token_ids)
        sampling = SamplingState.create(
            params, token_ids, eos_token_ids=self.eos_token_ids, device=self.device
        )
        sampling.grammar = grammar
        sampling.output_token_ids = request.output_token_ids  # one list, appended by the scheduler
        self.scheduler.add_request(request)
        self.states[request_id] = RequestState(request, sampling, self.outputs.new_detokenizer(token_ids))
        return request_id

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer, built on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer; this model has none")
                vocab = self.model_config.vocab_size
                self._grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
            return self._grammars

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (no-op for unknown or finished ids)."""
        if self.states.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def with_kv_compressor(self, compressor: Any) -> LLMEngine:
        """A new engine on the same model whose KV cache uses ``compressor`` (``kv.compressor.KVCompressor``),
        its block size included."""
        config = replace(
            self.config,
            kv=replace(self.config.kv, block_size=compressor.block_size),
            kv_compressor=compressor,
        )
        return LLMEngine(self.runner.model, self.model_config, self.tokenizer, config, self.kv_dtype)

    # ---- teacher-forced scoring -----------------------------------------------------------------------
    def score(
        self,
        token_ids: Sequence[int],
        prompt_len: int | None = None,
        prompt_chunk: int = 512,
        chunk_size: int = 1,
        request_id: str = "score",
    ) -> Iterator[ScoredChunk]:
        """The logits at every position of ``token_ids`` run through the paged KV path, chunk by chunk:
        ``ScoredChunk(start, logits (n, V))``. The first ``prompt_len`` tokens (all by default) go in
        ``prompt_chunk``-token chunks, the rest in ``chunk_size`` chunks, the evictor running between chunks.
        The engine must be idle; a caller holds one chunk of logits at a time (engines can run in lockstep)."""
        return teacher_forced_logits(self, token_ids, prompt_len, prompt_chunk, chunk_size, request_id)

    # ---- memory pressure (DTSS) ---------------------------------------------------------------------
    def _make_dtss(self, kv: KVConfig) -> DTSSController | None:
        if not kv.enable_dtss:
            return None
        if self.device.type == "cuda":
            total, available = (
                torch.cuda.mem_get_info(self.device)[1],
                lambda: torch.cuda.mem_get_info(self.device)[0],
            )
        else:
            total, available = hardware.total_memory_bytes(), hardware.available_memory_bytes
        return DTSSController.from_config(kv, total, available)

    def release_kv_shards(self, num_shards: int = 1) -> list[str]:
        """Take KV shards offline now: preempt the requests holding blocks there, free the memory."""
        victims = self.scheduler.release_kv_shards(num_shards)
        pool = self.kv_manager.pool
        self.stats.kv_bytes_released += self.cache.release_blocks(pool.num_online_blocks, pool.num_blocks)
        log.warning(
            "DTSS: %d KV shard(s) offline under memory pressure, %d request(s) preempted",
            num_shards,
            len(victims),
        )
        return victims

    def release_idle_memory(self) -> int:
        """With nothing running: hand the KV pages of the free blocks written since the last release back to the
        OS (CPU pools), and the heap's free pages; the process shrinks back after a burst of load. Returns the
        KV bytes released."""
        runs = self.kv_manager.pool.release_free_runs()
        released = sum(self.cache.release_blocks(s, e, free_above=top) for s, e, top in runs)
        self.stats.kv_bytes_released += released
        hardware.release_free_heap()
        return released

    def grow_kv_shards(self, num_shards: int = 1) -> None:
        self.scheduler.grow_kv_shards(num_shards)
        log.info("DTSS: %d KV shard(s) back online", num_shards)

    def _relieve_memory_pressure(self) -> None:
        """DTSS: take a KV shard offline when free memory runs low, bring one back when it recovers."""
        if self.dtss is None:
            return
        pool = self.kv_manager.pool
        decision = self.dtss.decide(pool.num_online_shards, pool.num_shards)
        if decision < 0:
            self.release_kv_shards(1)
        elif decision > 0:
            self.grow_kv_shards(1)

    def use_decode_graphs(self, max_batch: int, capture: bool = True) -> str | None:
        """Replay decode-only steps from graphs (``ModelRunner.enable_decode_graphs``); returns why not. A
        drafted step would leave the graph (run eagerly, costing many graph steps): graphs turn drafting off."""
        reason = self.runner.enable_decode_graphs(max_batch, self.max_model_len, capture=capture)
        if reason:
            log.info("decode steps run eagerly, without CUDA graphs: %s", reason)
        elif self.drafter is not None:  # the scheduler stops asking for drafts, the timer stops costing them
            self.drafter = self.scheduler.draft = self.timer.on_decode = None
            self.speculation_blocker = DRAFTS_LEAVE_GRAPHS
        return reason

    # ---- speculative decoding -------------------------------------------------------------------------
    def _propose_drafts(self, request: Request, num_decoding: int) -> list[int]:
        """The scheduler asks for drafts after a decoding request's next token."""
        state = self.states.get(request.request_id)
        if state is None or state.sampling.grammar is not None:  # a grammar would need its own rollback
            return []
        left = request.sampling_params.max_tokens - request.num_output_tokens  # tokens still to produce
        room = self.max_model_len - request.num_tokens  # positions left for drafts
        limit = min(left - 1, room)
        if limit <= 0:
            return []
        return self.drafter.propose(request.request_id, request.token_view, limit, num_decoding)

    @property
    def speculation(self) -> dict[str, Any]:
        """What speculative decoding does here: on/off (and why off), its settings and counters."""
        spec = self.config.speculative
        info: dict[str, Any] = {"enabled": self.drafter is not None, "method": spec.method}
        if self.drafter is None:
            info["reason"] = self.speculation_blocker
            return info
        info.update(num_tokens=spec.num_tokens, min_ngram=spec.min_ngram, max_ngram=spec.max_ngram)
        info.update(self.stats.speculation())
        return info

    # ---- the step -------------------------------------------------------------------------------
    def _peak_blocks_rule(self) -> Callable[[int], int] | None:
        """With eviction during chunked prefill a prompt longer than the pool streams through it: it never
        holds more than the kept blocks plus one chunk's."""
        sched = self.config.scheduler
        if self.evictor is None or not sched.enable_chunked_prefill:
            return None
        chunk = min(sched.long_prefill_token_threshold, sched.max_num_batched_tokens)
        return lambda num_tokens: self.evictor.peak_blocks(num_tokens, chunk)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute the batch and sample, then update the requests and emit outputs."""
        self._relieve_memory_pressure()
        out = self.scheduler.schedule()
        self._forget_kv(out.finished_ids + out.preempted_ids)
        results = self._drain_finished_by_scheduler(out)
        if out.is_empty:
            return results
        with self.timer.execute(out):
            sample_ids, logits, failed = execute_isolating(self.runner, out, self.fault_hook)
        logits, drafted = split_draft_rows(out, sample_ids, logits)
        with self.timer.phase("sample_ms"):
            states = [self.states[r].sampling for r in sample_ids]
            sampled = self.sampler.sample(logits, states) if sample_ids else None
        with self.timer.phase("detokenize_ms"):
            results += self._update(out, failed, sample_ids, sampled, drafted)
        return results

    def _update(
        self,
        out: SchedulerOutput,
        failed: dict[str, str],
        sample_ids: list[str],
        sampled: Any,
        drafted: dict[str, tuple[list[int], torch.Tensor]],
    ) -> list[RequestOutput]:
        """Append the sampled tokens, let the evictor drop blocks, and turn every request's news into outputs."""
        tokens = dict(zip(sample_ids, sampled.token_ids)) if sampled else {}
        ok_output = without_failed(out, failed)
        self._record_prompt_logprobs(ok_output)
        self.scheduler.update(ok_output, tokens)
        self._evict(ok_output)
        self._release_behind_windows(ok_output)
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.kv_manager.usage)
        results = [self._fail(request_id, error) for request_id, error in failed.items()]
        for i, request_id in enumerate(sample_ids):
            state = self.states[request_id]
            logprob = sampled.logprobs[i] if sampled.logprobs else None
            reason = self.outputs.append(state, tokens[request_id], logprob)
            num_new = 1
            if request_id in drafted:
                drafts, rows = drafted[request_id]
                reason, num_kept = self._verify_drafts(state, tokens[request_id], drafts, rows, reason)
                num_new += num_kept
            if reason is not None:
                self.scheduler.finish_request(request_id, reason)
                results.append(self._finish(request_id, reason, num_new_tokens=num_new))
            else:
                results.append(self.outputs.make_output(state, num_new, None))
        return results

    def _verify_drafts(
        self, state: RequestState, token: int, drafts: list[int], rows: torch.Tensor, reason: str | None
    ) -> tuple[str | None, int]:
        """Keep draft tokens while the sampler, run on each draft's own logits row as plain decoding would run
        it on that token's step, produced exactly that draft; each kept draft adds the sampler's next token.
        Exact: every token comes from the sampler, with the same state (penalties, seeded generator) as plain
        decoding, which would have fed it the same tokens. Returns the finish reason and the drafts kept."""
        request = state.request
        rid = request.request_id
        num_kept = 0
        running = request.status is RequestStatus.RUNNING  # else the scheduler finished it (max_model_len)
        while running and reason is None and num_kept < len(drafts) and token == drafts[num_kept]:
            sampled = self.sampler.sample(rows[num_kept : num_kept + 1], [state.sampling])
            token, logprob = sampled.token_ids[0], sampled.logprobs[0]
            num_kept += 1
            # False at max_model_len (FINISHED_LENGTH, reported by the next step)
            running = self.scheduler.accept_draft_token(rid, token)
            reason = self.outputs.append(state, token, logprob)
        self.drafter.observe(rid, len(drafts), num_kept)
        stats = self.stats
        stats.num_decode_tokens += num_kept
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += num_kept
        return reason, num_kept

    def _record_prompt_logprobs(self, out: SchedulerOutput) -> None:
        chunk_logits, self.runner.chunk_logits = self.runner.chunk_logits, {}
        for c in out.chunks:
            if c.request_id in chunk_logits and c.request_id in self.states:
                self.outputs.record_prompt_logprobs(
                    self.states[c.request_id], c.start_pos, chunk_logits[c.request_id]
                )

    def _evict(self, out: SchedulerOutput) -> None:
        """The eviction policy's turn after a step: it scores what the step attended and drops blocks."""
        if self.evictor is not None:
            self.evictor.after_step(
                out.chunks, self.runner.take_scores(), self.scheduler.get_request, self.lookahead_attention
            )

    def _release_behind_windows(self, out: SchedulerOutput) -> None:
        """When every layer slides, a running request's blocks wholly before its next query's widest window
        are read by no layer again: back to the pool (with interleaved full-attention layers none are)."""
        window = self._release_window
        if window is None:
            return
        for chunk in out.chunks:
            request = self.scheduler.get_request(chunk.request_id)
            if request is None or request.is_finished:
                continue
            first_needed = request.num_computed_tokens - window + 1
            released = self.kv_manager.release_before(chunk.request_id, first_needed)
            self.stats.num_window_released_blocks += released

    def lookahead_attention(self, requests: list[Request], num_tokens: int) -> dict[str, torch.Tensor]:
        """Draft ``num_tokens`` greedy tokens after each request's known tokens and return their attention per
        slot (``engine.lookahead``); rolled back. The evictor calls it when prompts complete."""
        return draft_attention(
            self.runner, self.kv_manager, requests, num_tokens, self.max_model_len, self.eos_token_ids
        )

    def _forget_kv(self, request_ids: list[str]) -> None:
        """Finished or preempted requests: drop their staging blocks, eviction scores and draft index."""
        if self.drafter is not None:
            self.drafter.forget(request_ids)
        if request_ids:
            self.cache.release_requests(request_ids)
            if self.evictor is not None:
                self.evictor.forget(request_ids)

    def kv_debug_report(self) -> dict:
        """KV compression debug checks: codec error per layer vs ``max_error``, shape checks,
        eviction counters, pool fragmentation."""
        report = self.cache.debug_report()
        computed = {
            rid: s.request.num_computed_tokens
            for rid, s in self.states.items()
            if s.request.num_computed_tokens > 0
        }
        report["pool"] = fragmentation_report(self.kv_manager, computed)
        report["eviction"] = self.evictor.report() if self.evictor is not None else None
        compressor = self.config.kv_compressor
        report["compressor"] = compressor.to_dict() if compressor is not None else None
        return report

    def _drain_finished_by_scheduler(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Requests the scheduler finished on its own (e.g. too large for the whole pool)."""
        results = []
        for request_id in out.finished_ids:
            state = self.states.get(request_id)
            if state is not None and state.request.is_finished:
                reason = state.request.finish_reason or "abort"
                results.append(self._finish(request_id, reason))
        return results

    def _fail(self, request_id: str, error: str) -> RequestOutput:
        state = self.states[request_id]
        state.request.error = error
        self.scheduler.finish_request(request_id, "error")
        self.counters.num_failed_requests += 1
        self.counters.errors.append(error)
        return self._finish(request_id, "error")

    def _finish(self, request_id: str, reason: str, num_new_tokens: int = 0) -> RequestOutput:
        state = self.states.pop(request_id)
        state.finish_time = time.perf_counter()
        self.counters.num_finished_requests += 1
        return self.outputs.make_output(state, num_new_tokens, reason)

    # ---- convenience ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run a list of prompts to completion, batched; outputs in input order."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[str, CompletionOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o.output
        return [done[i] for i in ids]

    def request_state(self, request_id: str) -> RequestState | None:
        return self.states.get(request_id)
