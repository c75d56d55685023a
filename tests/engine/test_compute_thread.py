"""ComputeThread runs every task on one thread (results and errors come back to the caller), and an
AsyncEngine given one steps on the thread that loaded its model, as `mcp2026 serve` does."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from mcp2026.config import EngineConfig, KVConfig
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.engine.compute_thread import ComputeThread
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

from conftest import save_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("tiny_compute"), max_position_embeddings=256))


def make_engine(tiny) -> LLMEngine:
    return LLMEngine(tiny.model, tiny.config, None, EngineConfig(KVConfig(num_blocks=64)))


def test_tasks_run_in_order_on_one_thread_and_errors_reach_the_caller():
    compute = ComputeThread(name="test-compute")
    seen = []
    assert compute.run(lambda a, b: a + b, 2, 3) == 5
    futures = [
        compute.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)
    ]
    for f in futures:
        f.result(timeout=10)
    assert seen == [(i, "test-compute") for i in range(5)]
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: compute.run(lambda: "nested")) == "nested"  # from its own thread: no deadlock

    class Model:  # stands in for a loaded model: an idle thread must not keep the last result alive
        pass

    ref = weakref.ref(compute.run(Model))
    gc.collect()
    assert ref() is None
    compute.stop()
    with pytest.raises(RuntimeError, match="has stopped"):
        compute.submit(lambda: None)  # refused at once, not queued behind the stop
    compute._thread.join(10)
    assert not compute.is_alive


def test_async_engine_steps_on_the_thread_that_loaded_the_model(tiny):
    compute = ComputeThread()
    engine = compute.run(make_engine, tiny)
    step_threads = set()
    step = engine.step

    def recording_step():
        step_threads.add(threading.get_ident())
        return step()

    engine.step = recording_step

    async def main():
        async_engine = AsyncEngine(engine, compute_thread=compute)
        async_engine.start()
        assert await async_engine.wait_ready()
        outs = [
            o async for o in async_engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        ]
        await async_engine.shutdown(drain=True)
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert outs[-1].finished and len(outs[-1].output.token_ids) == 4
    assert step_threads == {compute._thread.ident}
    assert compute.is_alive  # the caller's thread: AsyncEngine leaves it running
    compute.stop()
