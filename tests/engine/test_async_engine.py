"""AsyncEngine on a tiny random model: streams match the sync engine, leaving a stream aborts and frees
blocks, shutdown drains or aborts, and an escaped error marks the engine dead instead of hanging streams."""

from __future__ import annotations

import asyncio

import pytest

from mcp2026.config import EngineConfig, KVConfig, SpeculativeConfig
from mcp2026.engine.async_engine import AsyncEngine, EngineDeadError, EngineNotReadyError
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

from conftest import save_tiny_hf

NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("tiny_async"), max_position_embeddings=256))


def make_engine(tiny) -> LLMEngine:
    # one token per step: these tests stop streams part-way by the clock, and drafts would finish them first
    config = EngineConfig(KVConfig(num_blocks=NUM_BLOCKS), speculative=SpeculativeConfig(method="off"))
    return LLMEngine(tiny.model, tiny.config, None, config)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def started(tiny) -> AsyncEngine:
    engine = AsyncEngine(make_engine(tiny))
    engine.start()
    assert await engine.wait_ready()
    return engine


async def collect(engine: AsyncEngine, prompt, params=GREEDY, **kw):
    return [o async for o in engine.generate(prompt, params, **kw)]


async def wait_idle(engine: AsyncEngine) -> None:
    """Until every block is free again (commands run between steps on the loop thread)."""
    for _ in range(500):
        if engine.engine.kv_manager.num_free_blocks == NUM_BLOCKS and not engine.engine.has_unfinished():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("blocks did not come back")


PROMPTS = [[5, 6, 7, 8], list(range(10, 40)), [300, 2, 9]]


def test_streams_match_sync_engine(tiny):
    ref = [o.token_ids for o in make_engine(tiny).generate(PROMPTS, GREEDY)]

    async def main():
        engine = await started(tiny)
        assert engine.is_ready and engine.is_alive
        streams = await asyncio.gather(*(collect(engine, p) for p in PROMPTS))
        await engine.shutdown(drain=True)
        assert not engine.is_alive
        return streams

    streams = run(main())
    for outs, expected in zip(streams, ref):
        assert [t for o in outs for t in o.delta_token_ids] == expected
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])


def test_leaving_a_stream_aborts_and_frees_blocks(tiny):
    async def main():
        engine = await started(tiny)
        async for _ in engine.generate(PROMPTS[1], LONG):
            break  # consumer leaves after the first token
        await wait_idle(engine)
        task = asyncio.create_task(collect(engine, PROMPTS[1], LONG))
        await asyncio.sleep(0.05)
        task.cancel()  # like a client disconnect
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        engine.engine.kv_manager.check_integrity()
        assert engine.num_queued_requests == 0 and engine.num_in_flight == 0
        # Still serving afterwards.
        assert (await collect(engine, PROMPTS[0]))[-1].finish_reason == "length"
        await engine.shutdown(drain=False)

    run(main())


def test_an_idle_loop_hands_back_the_kv_memory_its_requests_wrote(tiny):
    async def main():
        engine = await started(tiny)
        before = engine.engine.stats.kv_bytes_released
        await asyncio.gather(*(collect(engine, p, LONG) for p in PROMPTS))
        await wait_idle(engine)
        for _ in range(500):  # the loop releases as it goes idle, right after its last step
            if engine.engine.stats.kv_bytes_released > before:
                break
            await asyncio.sleep(0.01)
        assert engine.engine.stats.kv_bytes_released > before
        assert (await collect(engine, PROMPTS[0]))[-1].finish_reason == "length"  # released blocks reused
        await engine.shutdown(drain=False)

    run(main())


def test_rejected_request_raises_and_loop_lives(tiny):
    async def main():
        engine = await started(tiny)
        with pytest.raises(ValueError, match="context"):
            await collect(engine, [5] * 300)
        with pytest.raises(ValueError, match="token ids"):
            await collect(engine, [99999])
        assert engine.is_alive and engine.num_queued_requests == 0
        await engine.shutdown(drain=False)

    run(main())


def test_fault_in_one_request_fails_only_that_request(tiny):
    async def main():
        engine = await started(tiny)

        def boom(chunk):
            if chunk.request_id == "bad":
                raise RuntimeError("injected")

        engine.engine.fault_hook = boom
        alone = await collect(engine, PROMPTS[0], request_id="bad")  # a batch of one
        assert alone[-1].finish_reason == "error" and "injected" in alone[-1].error
        bad, *good = await asyncio.gather(
            collect(engine, PROMPTS[0], request_id="bad"), *(collect(engine, p) for p in PROMPTS)
        )
        assert bad[-1].finish_reason == "error"
        assert [g[-1].finish_reason for g in good] == ["length"] * 3
        assert engine.is_alive
        await wait_idle(engine)
        await engine.shutdown(drain=False)

    run(main())


def test_shutdown_drain_finishes_in_flight_and_refuses_new(tiny):
    async def main():
        engine = await started(tiny)
        task = asyncio.create_task(
            collect(engine, PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        shutdown = asyncio.create_task(engine.shutdown(drain=True))
        await asyncio.sleep(0)
        assert not engine.is_ready
        with pytest.raises(EngineNotReadyError):
            await collect(engine, PROMPTS[0])
        outs = await task
        await shutdown
        assert outs[-1].finish_reason == "length" and len(outs[-1].output.token_ids) == 40

    run(main())


def test_shutdown_abort_ends_streams_with_abort(tiny):
    async def streaming(engine: AsyncEngine, prompt, first: asyncio.Event):
        outs = []
        async for o in engine.generate(prompt, LONG):
            outs.append(o)
            first.set()
        return outs

    async def main():
        engine = await started(tiny)
        firsts = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.create_task(streaming(engine, p, e)) for p, e in zip(PROMPTS, firsts)]
        for first in firsts:  # every stream has begun (a clock would race a fast machine)
            await first.wait()
        await engine.shutdown(drain=False)
        results = await asyncio.gather(*tasks)
        assert [r[-1].finish_reason for r in results] == ["abort"] * 3
        assert engine.engine.kv_manager.num_free_blocks == NUM_BLOCKS

    run(main())


def test_escaped_error_marks_engine_dead(tiny):
    async def main():
        engine = await started(tiny)
        calls = {"n": 0}
        step = engine.engine.step

        def broken_step():
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("scheduler bug")
            return step()

        engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="scheduler bug"):
            await collect(engine, PROMPTS[1], LONG)
        assert not engine.is_alive and not engine.is_ready
        assert "scheduler bug" in engine.dead_error
        with pytest.raises(EngineDeadError):
            await collect(engine, PROMPTS[0])
        assert engine.engine.kv_manager.num_free_blocks == NUM_BLOCKS  # in-flight requests were aborted
        await engine.shutdown(drain=False)

    run(main())


def test_idle_loop_does_not_step(tiny):
    async def main():
        engine = await started(tiny)
        await collect(engine, PROMPTS[0])
        calls = {"n": 0}
        step = engine.engine.step

        def counting_step():
            calls["n"] += 1
            return step()

        engine.engine.step = counting_step
        await asyncio.sleep(0.3)
        assert calls["n"] == 0
        await collect(engine, PROMPTS[0])
        assert calls["n"] > 0
        await engine.shutdown(drain=False)

    run(main())


def test_request_keeps_the_arrival_time_it_reached_the_server_with(tiny):
    # The scheduler orders by arrival; a request added by the loop thread after a long step must keep the
    # time it arrived, not the time the loop got to it.
    import time

    from mcp2026.engine.async_engine import RequestTiming

    async def main():
        engine = await started(tiny)
        seen = {}
        add = engine.engine.scheduler.add_request
        engine.engine.scheduler.add_request = lambda r: (seen.setdefault("arrival", r.arrival_time), add(r))
        timing = RequestTiming(arrival_time=time.perf_counter() - 5.0)  # arrived 5 s ago
        await collect(engine, PROMPTS[0], timing=timing)
        await engine.shutdown(drain=True)
        return seen["arrival"]

    arrival = run(main())
    assert 4.5 < time.monotonic() - arrival < 30


@pytest.mark.parametrize(("num_blocks", "prompt_len"), [(NUM_BLOCKS, 252), (8, 126)])
def test_warm_up_prefills_a_real_prompt_that_the_pool_holds(tiny, num_blocks, prompt_len):
    """The warm-up runs a prefill long enough for the prefill kernels (max_model_len 256 caps it at 252), and
    halves it until a tiny pool could hold it (8 blocks of 16: 126 tokens + 2 new ones)."""
    from mcp2026.engine import async_engine

    engine = LLMEngine(tiny.model, tiny.config, None, EngineConfig(KVConfig(num_blocks=num_blocks)))
    seen = []
    generate = engine.generate
    engine.generate = lambda prompts, params: seen.append(len(prompts[0])) or generate(prompts, params)
    AsyncEngine(engine)._warm_up()
    assert async_engine.WARMUP_PROMPT_TOKENS == 256 and seen == [prompt_len]


@pytest.mark.parametrize(("interval_s", "trims_under_load"), [(0.0, True), (3600.0, False)])
def test_heap_is_trimmed_under_load_every_interval(tiny, monkeypatch, interval_s, trims_under_load):
    """A server that never goes idle still hands freed step temporaries back to the OS: the loop trims the
    heap every HEAP_TRIM_INTERVAL_S seconds of steps, and not more often."""
    from mcp2026.engine import async_engine

    busy_trims: list[bool] = []

    async def go():
        engine = await started(tiny)
        monkeypatch.setattr(async_engine, "HEAP_TRIM_INTERVAL_S", interval_s)
        monkeypatch.setattr(
            async_engine.hardware,
            "release_free_heap",
            lambda: busy_trims.append(engine.engine.has_unfinished()),
        )
        await collect(engine, PROMPTS[1])
        await engine.shutdown(drain=True)

    run(go())
    assert any(busy_trims) == trims_under_load
