"""AsyncEngine: the LLMEngine driven by one background thread, with one asyncio token stream per request.

The model forward is blocking torch code, so ``step()`` runs on a dedicated thread: a ``ComputeThread``, the
one the model was loaded on where the caller passes it (see compute_thread.py for why). The engine is not
thread-safe: every ``add_request``/``abort`` is queued as a command that the loop thread runs between
steps. Outputs go back to the event loop with ``call_soon_threadsafe`` into per-request asyncio queues.
A failure the engine does not isolate to one request is logged, fails every live stream and marks the
engine dead (``is_alive`` turns false, so /healthz fails) instead of killing the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mcp2026 import hardware
from mcp2026.engine.compute_thread import ComputeThread
from mcp2026.engine.engine import LLMEngine
from mcp2026.engine.output_processor import RequestOutput
from mcp2026.engine.request import RequestStatus
from mcp2026.engine.scheduler import SchedulerStats
from mcp2026.types import EmbeddingParams, EmbeddingResult, SamplingParams

log = logging.getLogger(__name__)
WARMUP_PROMPT_TOKENS = 256  # the warm-up prompt: past the GEMV row limits, so prefill kernels run too
# Under load glibc keeps the steps' freed temporaries mapped (in the heap and each thread's arena) until
# something trims them; a trim takes a few ms, so once every few seconds of load costs well under 1%.
HEAP_TRIM_INTERVAL_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error no single request could be blamed for."""


class EngineNotReadyError(RuntimeError):
    """The engine is not started yet, draining or stopped: it accepts no new requests."""


@dataclass
class RequestTiming:
    """Wall times of one request (perf_counter seconds), filled by the loop thread."""

    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # start of the first step that computed any of its tokens

    @property
    def queue_time_s(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


@dataclass
class _Stream:
    """The event-loop side of one request: where its outputs go."""

    queue: asyncio.Queue
    added: asyncio.Future  # resolved once the loop thread added the request (or rejected it)
    num_prompt_tokens: int
    timing: RequestTiming
    has_first_output: bool = False


class AsyncEngine:
    """Call ``start()`` from inside the running event loop that will consume the streams; ``generate``
    then yields the request's ``RequestOutput``s until one is finished. Not bound to a second loop."""

    def __init__(
        self, engine: LLMEngine, *, warmup: bool = True, compute_thread: ComputeThread | None = None
    ) -> None:
        self.engine = engine
        self.warmup = warmup
        self._cond = threading.Condition()  # guards _commands, _should_stop
        self._commands: deque[Callable[[], None]] = deque()
        self._should_stop = False
        self._compute = compute_thread  # None: a thread of its own, started by start()
        self._owns_compute = compute_thread is None
        self._running: concurrent.futures.Future[None] | None = None  # the loop, once started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}  # event-loop thread only
        self._embeddings: set[asyncio.Future[None]] = set()  # embed calls waiting (event-loop thread only)
        self._unscheduled: dict[str, RequestTiming] = {}  # loop thread only
        self._ids = itertools.count()
        self._is_warm = False
        self._last_heap_trim = time.perf_counter()  # engine thread only
        self._is_accepting = False
        self.dead_error: str | None = None
        self.stats: SchedulerStats = engine.scheduler.stats  # refreshed after each step
        self.num_queued_requests = 0  # added, no output yet (event-loop thread)
        self.num_queued_tokens = 0  # their prompt tokens

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread; must be called from the event loop that will consume the streams."""
        if self._running is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        if self._compute is None:
            self._compute = ComputeThread()
        self._is_accepting = True
        self._running = self._compute.submit(self._run)
        self._running.add_done_callback(_log_loop_exception)

    @property
    def is_started(self) -> bool:
        return self._running is not None

    @property
    def is_alive(self) -> bool:
        """The loop runs and has not died from an error."""
        return self._running is not None and not self._running.done() and self.dead_error is None

    @property
    def is_ready(self) -> bool:
        """Alive, warmed up and accepting new requests (not draining)."""
        return self.is_alive and self._is_warm and self._is_accepting

    async def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait until warm (or dead, or ``timeout_s``); returns ``is_ready``."""
        deadline = time.monotonic() + timeout_s
        while not self._is_warm and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.is_ready

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, drain: bool, timeout_s: float = 30.0) -> None:
        """Refuse new requests; ``drain`` lets in-flight ones finish (up to ``timeout_s``, then abort them),
        otherwise abort them now with finish_reason "abort". Stops the loop thread."""
        self._is_accepting = False
        if drain and self.is_alive:
            deadline = time.monotonic() + timeout_s
            while (self._streams or self._embeddings) and self.is_alive and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self._submit(lambda rid=request_id: self._abort_with_output(rid))
        while self._streams and self.is_alive:
            await asyncio.sleep(0.01)
        with self._cond:
            self._should_stop = True
            self._cond.notify()
        if self._running is not None:
            await asyncio.to_thread(concurrent.futures.wait, [self._running], 10.0)
            if self._owns_compute:
                self._compute.stop()
        self._fail_all(EngineNotReadyError("the engine was shut down"))

    # ---- requests -------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timing: RequestTiming | None = None,
        tenant: str | None = None,
        ttft_deadline_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; raises ValueError if the engine rejects the request. Leaving the
        iteration early (break, cancellation, client disconnect) aborts the request and frees its blocks.
        ``ttft_deadline_s``: the first token is wanted this long after arrival (the "deadline" policy)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error}")
        if not self._is_accepting or self._loop is None:
            raise EngineNotReadyError("the engine is not accepting requests (not started or draining)")
        request_id = request_id or f"cmpl-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        timing = timing or RequestTiming()
        added: asyncio.Future[None] = self._loop.create_future()
        stream = _Stream(asyncio.Queue(), added, len(prompt_ids), timing)
        self._streams[request_id] = stream
        self.num_queued_requests += 1
        self.num_queued_tokens += stream.num_prompt_tokens
        prompt = list(prompt_ids)
        # The scheduler orders by arrival: the time the request reached us, not when the loop thread (busy
        # with a step) gets to add it, so requests arriving during a step are ordered among themselves.
        arrival = time.monotonic() - (time.perf_counter() - timing.arrival_time)
        keys = {"priority": priority, "cache_salt": cache_salt, "tenant": tenant, "arrival_time": arrival}
        if ttft_deadline_s is not None:
            keys["ttft_deadline"] = arrival + ttft_deadline_s
        self._submit(lambda: self._add(request_id, prompt, params, keys, timing, added))
        finished = False
        try:
            await added
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            added.cancel()  # no-op once resolved; else nobody waits for the result any more
            self._close_stream(request_id)
            if not finished:
                self.abort(request_id)

    async def embed(self, inputs: Sequence[Sequence[int]], params: EmbeddingParams) -> EmbeddingResult:
        """Embed token-id inputs (``Embedder.embed``) on the loop thread, one forward between two steps, so
        running requests keep stepping while a large batch is embedded. Bad inputs raise ValueError."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error}")
        if not self._is_accepting or self._loop is None:
            raise EngineNotReadyError("the engine is not accepting requests (not started or draining)")
        embedder = self.engine.embedder
        embedder.check_params(params)
        token_lists = [embedder.token_ids(item, i) for i, item in enumerate(inputs)]
        if not token_lists:
            raise ValueError("no inputs to embed: give at least one")
        batches = embedder.batches(token_lists)
        vectors: list[list[float]] = [[] for _ in token_lists]
        done: asyncio.Future[None] = self._loop.create_future()
        self._embeddings.add(done)
        abandoned = threading.Event()  # the caller left: the remaining forwards are skipped

        def run(batch_index: int) -> None:
            if abandoned.is_set():
                return
            batch = batches[batch_index]
            try:
                rows = embedder.forward([token_lists[i] for i in batch], params).tolist()
            except Exception as e:  # noqa: BLE001 - a failed forward fails this call, not the loop
                log.exception("embedding forward failed")
                self._to_event_loop(_set_future, done, e)
                return
            for i, row in zip(batch, rows):
                vectors[i] = row
            if batch_index + 1 < len(batches):
                self._submit(lambda: run(batch_index + 1))  # after the next step
            else:
                self._to_event_loop(_set_future, done, None)

        self._submit(lambda: run(0))
        try:
            await done
        finally:
            abandoned.set()
            self._embeddings.discard(done)
        return EmbeddingResult(vectors, [len(t) for t in token_lists])

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        self._submit(lambda: self.engine.abort(request_id))

    def run_between_steps(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the loop thread before the next step (the engine is not thread-safe). An
        exception it raises is logged, not fatal."""

        def guarded() -> None:
            try:
                command()
            except Exception:  # noqa: BLE001 - a failed command must not kill the loop
                log.exception("engine command %s failed", getattr(command, "__name__", command))

        self._submit(guarded)

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        """Fair-share weights of tenants (``tenant`` of ``generate``); others weigh 1."""
        bad = {name: w for name, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"fair-share weights must be > 0, got {bad}")
        fair_share, weights = self.engine.scheduler.fair_share, dict(weights)
        self.run_between_steps(lambda: fair_share.weights.update(weights))

    # ---- event-loop side ------------------------------------------------------------------------
    def _close_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.has_first_output:
            stream.has_first_output = True
            self.num_queued_requests -= 1
            self.num_queued_tokens -= stream.num_prompt_tokens

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # the consumer left; its abort is queued
            if not stream.has_first_output:
                stream.has_first_output = True
                self.num_queued_requests -= 1
                self.num_queued_tokens -= stream.num_prompt_tokens
            stream.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for done in self._embeddings:
            _set_future(done, error)
        for stream in self._streams.values():
            if stream.added.done():
                stream.queue.put_nowait(error)
            else:
                stream.added.set_exception(error)

    def _to_event_loop(self, fn: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            log.debug("event loop closed; dropped %s", getattr(fn, "__name__", fn))

    # ---- loop thread ----------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        keys: dict[str, Any],
        timing: RequestTiming,
        added: asyncio.Future[None],
    ) -> None:
        try:
            self.engine.add_request(prompt, params, request_id, **keys)
        except Exception as e:  # noqa: BLE001 - a rejected request goes back to its caller, not the loop
            self._to_event_loop(_set_future, added, e)
            return
        self._unscheduled[request_id] = timing
        self._to_event_loop(_set_future, added, None)

    def _abort_with_output(self, request_id: str) -> None:
        state = self.engine.request_state(request_id)
        if state is None:
            return
        self.engine.abort(request_id)
        self._to_event_loop(self._deliver, [self.engine.outputs.make_output(state, 0, "abort")])

    def _run(self) -> None:
        try:
            if self.warmup:
                self._warm_up()
            self._is_warm = True
            while self._run_once():
                pass
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            log.exception("engine loop died")
            self.dead_error = f"{type(e).__name__}: {e}"
            self._abort_all_after_death()
            self._to_event_loop(self._fail_all, EngineDeadError(f"the engine loop died: {self.dead_error}"))

    def _run_once(self) -> bool:
        """Run queued commands and one step; wait (no spinning) while idle. False when asked to stop."""
        with self._cond:
            if not self._commands and not self._should_stop and not self.engine.has_unfinished():
                self.engine.release_idle_memory()
            while not self._commands and not self._should_stop and not self.engine.has_unfinished():
                self.engine.kv_manager.check_integrity()
                self._cond.wait()
            if self._should_stop:
                return False
            commands, self._commands = self._commands, deque()
        for command in commands:
            command()
        if not self.engine.has_unfinished():
            return True
        step_start = time.perf_counter()
        outputs = self.engine.step()
        self._mark_scheduled(step_start)
        if step_start - self._last_heap_trim >= HEAP_TRIM_INTERVAL_S:
            hardware.release_free_heap()
            self._last_heap_trim = step_start
        self.stats = self.engine.scheduler.stats
        if outputs:
            self._to_event_loop(self._deliver, outputs)
        return True

    def _mark_scheduled(self, step_start: float) -> None:
        for request_id, timing in list(self._unscheduled.items()):
            request = self.engine.scheduler.get_request(request_id)
            if request is None or request.status is RequestStatus.RUNNING or request.num_computed_tokens:
                timing.scheduled_time = step_start
                del self._unscheduled[request_id]

    def _warm_up(self) -> None:
        """One request through the whole path before /readyz: a prefill long enough to take the prefill GEMMs
        and attention (their first calls allocate buffers and build oneDNN primitives), then decode steps. A
        one-token warm-up would leave that cost to the first real prompts."""
        bos = self.engine.model_config.bos_token_id
        token = bos if bos is not None and bos < self.engine.model_config.vocab_size else 0
        num_tokens = max(1, min(WARMUP_PROMPT_TOKENS, self.engine.max_model_len - 4))
        while num_tokens > 1 and not self.engine.kv_manager.can_ever_fit(num_tokens + 2):  # a tiny pool
            num_tokens //= 2
        self.engine.generate([[token] * num_tokens], SamplingParams(max_tokens=2, ignore_eos=True))

    def _abort_all_after_death(self) -> None:
        for request_id in list(self.engine.states):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - best effort: the engine state may be what broke
                log.exception("abort of %s after engine death failed", request_id)


def _log_loop_exception(running: concurrent.futures.Future[None]) -> None:
    """``_run`` reports its own errors; one raised while it reports would otherwise vanish in the future."""
    if not running.cancelled() and running.exception() is not None:
        log.error("engine loop ended with an unreported error", exc_info=running.exception())


def _set_future(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
