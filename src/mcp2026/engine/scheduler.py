"""The scheduler decides, each step, which tokens of which requests to compute within a token budget.

Pure Python, no torch: running requests first (decodes, then the next chunk of prompts still catching up),
then waiting requests in policy order. Preemption frees a request's blocks; it recomputes later through
the same path as a new prompt (prefix hits make that cheap). Across tenants (``Request.tenant``),
``FairShare`` interleaves both queues so each busy tenant's processed tokens follow its weight; the policy
orders work inside a tenant, and preemption takes from the tenant furthest ahead first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mcp2026.config import SchedulerConfig
from mcp2026.engine.fair_share import FairShare, Tenant
from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.engine.policies import make_policy
from mcp2026.engine.request import Request, RequestStatus
from mcp2026.kv.manager import KVCacheManager


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prefix_query_blocks: int  # full blocks looked up when requests were admitted
    num_prefix_hit_blocks: int
    num_cached_tokens: int  # prompt tokens served by prefix hits at first admission
    kv_usage: float
    tenant_tokens: dict[Tenant, int] = field(default_factory=dict)  # tokens computed per tenant


@dataclass
class _Step:
    """What one ``schedule`` call has handed out so far."""

    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> draft tokens after its next
    num_preempted: int = 0
    num_decoding: int = 0  # running requests with exactly one token to compute

    def add(self, request_id: str, num_tokens: int, drafts: list[int] | None = None) -> None:
        self.scheduled[request_id] = num_tokens
        self.budget -= num_tokens
        if drafts:
            self.drafts[request_id] = drafts

    def drop(self, request_id: str) -> None:
        self.budget += self.scheduled.pop(request_id, 0)
        self.drafts.pop(request_id, None)


class Scheduler:
    """Owns the waiting and running queues and every added, unfinished request.

    Invariants: running requests hold blocks covering their computed tokens; waiting and preempted ones
    hold none; ``len(running) <= max_num_seqs``; each output's tokens <= ``max_num_batched_tokens``.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        peak_blocks: Callable[[int], int] | None = None,
        draft: Callable[[Request, int], list[int]] | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        # Speculative decoding: draft tokens for a decoding request in a step decoding n requests ([]: none);
        # they are computed after its next token and the engine keeps what the sampler agrees with.
        self.draft = draft
        # Blocks a request of n tokens holds at most at once (less than all of them when KV eviction runs
        # during chunked prefill); by default every block.
        self.peak_blocks = peak_blocks or kv.num_blocks_for
        # Prefill tokens per second of recent steps (``observe_prefill``); sizes chunks when
        # ``long_prefill_ms`` is set. Not with a peak-blocks rule: its admission assumes the fixed chunk.
        self.prefill_tokens_per_s: float | None = None
        self._chunks_follow_rate = peak_blocks is None and config.long_prefill_ms is not None
        # The config may only lower the model's context length.
        self.max_model_len = min(max_model_len, config.max_model_len or max_model_len)
        self.policy = make_policy(config.policy, config.aging_tokens_per_s)
        self.fair_share = FairShare()
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._finished_ids: list[str] = []  # reported by the next schedule()
        self._preempted_ids: list[str] = []
        self._next_arrival_index = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0

    # --- queries -------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions,
            num_prefix_query_blocks=self.kv.cache.num_queries,
            num_prefix_hit_blocks=self.kv.cache.num_hits,
            num_cached_tokens=self.num_cached_tokens,
            kv_usage=self.kv.usage,
            tenant_tokens=dict(self.fair_share.num_processed),
        )

    # --- requests in and out -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if not request.prompt_token_ids:
            raise ValueError(f"request {rid}: the prompt is empty")
        if rid in self._requests:
            raise ValueError(f"request {rid}: a request with this id is already scheduled")
        if request.num_prompt_tokens + 1 > self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt of {request.num_prompt_tokens} tokens plus 1 generated token exceeds "
                f"max_model_len={self.max_model_len}"
            )
        if (
            not self.config.enable_chunked_prefill
            and request.num_prompt_tokens > self.config.max_num_batched_tokens
        ):
            raise ValueError(
                f"request {rid}: prompt of {request.num_prompt_tokens} tokens exceeds max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} and chunked prefill is disabled"
            )
        request.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self._waiting.append(request)
        self.fair_share.add(request.tenant)

    def finish_request(self, request_id: str, reason: RequestStatus | str) -> bool:
        """Finish with ``reason`` ("stop" | "length" | "abort" | "error" or a FINISHED_* status) and free its
        blocks. False (a no-op) if the request is unknown or already finished."""
        status = RequestStatus.finished(reason)
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        queue = self._running if request.status is RequestStatus.RUNNING else self._waiting
        queue.remove(request)
        self.fair_share.remove(request.tenant)
        self.kv.free(request)
        request.status = status
        self._finished_ids.append(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # --- one step ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        if self.draft is not None:  # what the drafter weighs a longer step against
            step.num_decoding = sum(1 for r in self._running if r.num_tokens - r.num_computed_tokens == 1)
        deferred = self._schedule_running(step)
        # NOTE: after a preemption, admitting new work would only take the blocks back (thrashing).
        if step.num_preempted == 0:
            self._schedule_waiting(step, deferred)
        self._schedule_in_order(deferred, step, may_preempt=False)
        self.fair_share.charge(self._tokens_by_tenant(step))
        chunks = [
            self._make_chunk(self._requests[rid], n, step.drafts.get(rid, []))
            for rid, n in step.scheduled.items()
        ]
        chunks.sort(key=lambda c: c.num_tokens > 1)  # stable: decodes first (then drafted decodes, prefills)
        output = SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=sum(step.scheduled.values()),
            preempted_ids=self._preempted_ids,
            finished_ids=self._finished_ids,
        )
        self._preempted_ids, self._finished_ids = [], []
        return output

    def _schedule_running(self, step: _Step) -> list[Request]:
        """Decodes, then catching-up prefills, in policy order; returns the prefills deferred behind waiting
        requests the policy puts first (``_schedule_waiting`` merges them back in key order)."""

        # Decodes before catching-up prefills so a long prompt cannot stall token streams.
        def is_prefill(r: Request) -> bool:
            return r.num_tokens - r.num_computed_tokens > 1

        order = self.fair_share.order(
            self._running, lambda r: (is_prefill(r), self.policy.key(r)), self._cost, group=is_prefill
        )
        # With ``sjf`` a prompt part-way through chunked prefill does not outrank a waiting prompt of its tenant
        # that sorts first (a burst's short prompts that arrived while a long one's first chunk ran). Only sjf:
        # its aging bounds how long a prompt can be passed over; priority and deadline have no aging, and
        # under FCFS nothing waiting sorts first but preempted requests. Across tenants, FairShare decides.
        yielding = self.policy.part_prefills_yield and any(is_prefill(r) for r in self._running)
        heads = self._heads_of_waiting() if yielding else {}
        if not heads:
            self._schedule_in_order(order, step)
            return []

        def yields(r: Request) -> bool:
            head = heads.get(r.tenant)
            return head is not None and is_prefill(r) and self.policy.key(r) > head

        deferred = [r for r in order if yields(r)]
        self._schedule_in_order([r for r in order if not yields(r)], step)
        return deferred

    def _heads_of_waiting(self) -> dict[Tenant, tuple]:
        """Per tenant, the policy key of its first waiting request (none when no request may be admitted)."""
        heads: dict[Tenant, tuple] = {}
        if len(self._running) >= self.config.max_num_seqs:
            return heads
        for r in self._waiting:
            key = self.policy.key(r)
            if r.tenant not in heads or key < heads[r.tenant]:
                heads[r.tenant] = key
        return heads

    def _schedule_in_order(self, order: list[Request], step: _Step, may_preempt: bool = True) -> None:
        """Give each running request its next tokens within the budget. Without ``may_preempt`` (deferred
        prefills, scheduled after this step's admissions) a request that finds no free blocks waits for a
        later step instead of preempting what was just admitted."""
        for request in order:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if step.budget == 0:
                break
            if not self._check_fits(request):
                continue
            num_new = self._num_new_tokens(request.num_tokens - request.num_computed_tokens, step.budget)
            if num_new == 0:
                continue
            if num_new == 1 and self._schedule_drafted(request, step):
                continue
            while not self.kv.allocate_slots(request, num_new):
                if not may_preempt:
                    break
                victim = max(self._running, key=self._victim_key)
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                step.add(request.request_id, num_new)

    def _schedule_drafted(self, request: Request, step: _Step) -> bool:
        """A decoding request's next token plus draft tokens, if the drafter proposes some and free blocks
        hold them (drafts never evict cached prefixes nor preempt). False: schedule it plainly."""
        if self.draft is None or request.num_tokens - request.num_computed_tokens != 1:
            return False
        drafts = self.draft(request, step.num_decoding)[: step.budget - 1]
        if not drafts or not self.kv.allocate_slots(request, 1 + len(drafts), evict_cached=False):
            return False
        step.add(request.request_id, 1 + len(drafts), drafts)
        return True

    def _schedule_waiting(self, step: _Step, deferred: list[Request]) -> None:
        # Strict policy order (stop at the first request that does not fit): nothing overtakes a long
        # prompt at the head of the queue, so it cannot starve; chunking lets it start within any budget.
        # Deferred prefills (sjf) take their turn when the first waiting request of their tenant that sorts
        # after them comes up.
        waiting = self.fair_share.order(
            self._waiting, self.policy.key, self._cost, self._tokens_by_tenant(step)
        )
        for request in waiting:
            due = [
                d
                for d in deferred
                if d.tenant == request.tenant and self.policy.key(d) < self.policy.key(request)
            ]
            if due:
                due_ids = {d.request_id for d in due}
                deferred[:] = [d for d in deferred if d.request_id not in due_ids]
                self._schedule_in_order(due, step, may_preempt=False)
            if step.budget == 0 or len(self._running) >= self.config.max_num_seqs:
                break
            if not self._check_fits(request):
                continue
            # prompt logprobs need the logits of every prompt token: nothing may come from the prefix cache
            wants_all = request.sampling_params.prompt_logprobs is not None
            hit_ids, num_hit = ([], 0) if wants_all else self.kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request.num_tokens - num_hit, step.budget)
            if num_new == 0 or not self._allocate_for_waiting(request, num_new, hit_ids, step):
                break
            self._waiting.remove(request)
            self._running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
                self.num_cached_tokens += num_hit
            step.add(request.request_id, num_new)

    def _allocate_for_waiting(self, request: Request, num_new: int, hit_ids: list[int], step: _Step) -> bool:
        while not self.kv.allocate_slots(request, num_new, hit_ids):
            if not self.policy.preempts_for_waiting or not self._running:
                return False
            victim = max(self._running, key=self._victim_key)
            if self._victim_key(victim) < self._victim_key(request):
                return False
            self._preempt(victim, step)
        return True

    def _victim_key(self, request: Request) -> tuple:
        """Preempted first: the largest key (the busy tenant furthest ahead, then the policy's last)."""
        return (self.fair_share.tag(request.tenant), self.policy.key(request))

    def _cost(self, request: Request) -> int:
        """Tokens a request would take in one step (the fair-share tag it advances by)."""
        remaining = request.num_tokens - request.num_computed_tokens
        return min(remaining, self.chunk_cap(), self.config.max_num_batched_tokens)

    # EMA weight of a step's rate; steps with fewer prefill tokens say little about the rate (fixed costs)
    _RATE_WEIGHT, _RATE_MIN_TOKENS = 0.3, 64

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """The engine ran ``num_tokens`` prefill tokens in a step of ``seconds``."""
        if num_tokens < self._RATE_MIN_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else old + self._RATE_WEIGHT * (rate - old)

    def chunk_cap(self) -> int:
        """The longest prefill chunk of a step: ``long_prefill_token_threshold``, or the multiple of it that
        the measured prefill rate runs in ``long_prefill_ms`` where that is more (never past the step budget).
        Whole multiples: a rate that drifts a little does not move every chunk boundary."""
        cap = threshold = self.config.long_prefill_token_threshold
        if self._chunks_follow_rate and self.prefill_tokens_per_s:
            affordable = self.prefill_tokens_per_s * self.config.long_prefill_ms / 1000
            cap = threshold * max(1, int(affordable // threshold))
        return min(cap, self.config.max_num_batched_tokens)

    def _tokens_by_tenant(self, step: _Step) -> dict[Tenant, int]:
        tokens: dict[Tenant, int] = {}
        for rid, num in step.scheduled.items():
            tenant = self._requests[rid].tenant
            tokens[tenant] = tokens.get(tenant, 0) + num
        return tokens

    def _num_new_tokens(self, num_remaining: int, budget: int) -> int:
        if num_remaining == 1 and budget > 0:  # a decode: the same under every rule below
            return 1
        if self.config.enable_chunked_prefill:
            num_new = min(num_remaining, self.chunk_cap(), budget)
        elif num_remaining <= budget:
            return num_remaining
        else:
            # Without chunking, only a recompute longer than any step's budget is split (else it would never run).
            num_new = budget if num_remaining > self.config.max_num_batched_tokens else 0
        return num_new

    def _check_fits(self, request: Request) -> bool:
        """Finish (error) a request that needs more blocks than the whole online pool: it could only wait
        forever or preempt everything forever."""
        if self.peak_blocks(request.num_tokens) <= self.kv.num_online_blocks:
            return True
        request.error = (
            f"request {request.request_id} needs {self.peak_blocks(request.num_tokens)} KV blocks for "
            f"{request.num_tokens} tokens, but the cache has only {self.kv.num_online_blocks} blocks of "
            f"{self.kv.block_size} tokens online"
        )
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return False

    def _preempt(self, request: Request, step: _Step | None) -> None:
        self.kv.free(request, preempted=True)
        self._running.remove(request)
        self._waiting.append(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids.append(request.request_id)
        if step is not None:
            step.drop(request.request_id)
            step.num_preempted += 1

    def _make_chunk(self, request: Request, num_tokens: int, drafts: list[int]) -> ScheduledChunk:
        start = request.num_computed_tokens
        num_known = num_tokens - len(drafts)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, start + num_known) + drafts,
            start_pos=start,
            block_table=self.kv.block_table(request.request_id),
            samples=start + num_known == request.num_tokens,
            num_draft_tokens=len(drafts),
            wants_all_logits=(
                request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens
            ),
            kv_offset=self.kv.num_dropped_tokens(request.request_id),
        )

    # --- after the runner ----------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Advance each chunk's request by its tokens and append the sampled token where ``samples``.
        Chunks of requests finished or preempted since ``output`` was made are skipped. Returns the
        requests that got a token; one that reached max_model_len is already FINISHED_LENGTH."""
        missing = [rid for rid in output.sampling_ids if rid not in sampled]
        if missing:
            raise ValueError(f"runner returned no sampled token for requests {missing}")
        new_token: list[Request] = []
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if (
                request is None
                or request.status is not RequestStatus.RUNNING
                or request.num_computed_tokens != chunk.start_pos
            ):
                continue
            request.num_computed_tokens += chunk.num_tokens - chunk.num_draft_tokens
            if chunk.samples:
                request.output_token_ids.append(int(sampled[chunk.request_id]))
                new_token.append(request)
            self.kv.cache_full_blocks(request)
            if chunk.samples and request.num_tokens >= self.max_model_len:
                self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        return new_token

    def accept_draft_token(self, request_id: str, token: int) -> bool:
        """The sampler kept the request's next draft token (its KV was computed in the step just run) and
        produced ``token`` after it: one more computed token, one more output token. Returns whether the
        request still runs (at max_model_len it is FINISHED_LENGTH, reported by the next ``schedule``)."""
        request = self._requests[request_id]
        request.num_computed_tokens += 1
        request.output_token_ids.append(int(token))
        self.kv.cache_full_blocks(request)
        if request.num_tokens >= self.max_model_len:
            self.finish_request(request_id, RequestStatus.FINISHED_LENGTH)
            return False
        return True

    # --- DTSS ----------------------------------------------------------------------------------------------
    def release_kv_shards(self, num_shards: int) -> list[str]:
        """Take the highest KV shards offline, preempting every request holding blocks there (reported in
        the next output's ``preempted_ids``). Returns their ids."""
        block_ids = self.kv.release_shards(num_shards)
        victim_ids = self.kv.request_ids_holding(block_ids)
        for rid in victim_ids:
            self._preempt(self._requests[rid], None)
        return victim_ids

    def grow_kv_shards(self, num_shards: int) -> None:
        self.kv.grow_shards(num_shards)
