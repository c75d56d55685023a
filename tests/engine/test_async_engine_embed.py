"""AsyncEngine.embed on a tiny random model: the sync embedder's vectors, one forward between two steps of a
running request (which keeps its tokens), bad inputs raised to the caller, pending calls failed at shutdown."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.async_engine import AsyncEngine, EngineNotReadyError
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import load_model
from mcp2026.types import EmbeddingParams, SamplingParams

from conftest import save_tiny_hf

INPUTS = [list(range(3, 3 + n)) for n in (20, 7, 30, 12, 25)]  # 94 tokens: 4 forwards of at most 32
PARAMS = EmbeddingParams("mean")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("tiny_async_embed"), max_position_embeddings=256))


def make_engine(tiny) -> LLMEngine:
    config = EngineConfig(KVConfig(num_blocks=64), SchedulerConfig(max_num_batched_tokens=32))
    return LLMEngine(tiny.model, tiny.config, None, config)


def test_embed_interleaves_with_steps(tiny):
    sync = make_engine(tiny)
    expected = sync.embedder.embed(INPUTS, PARAMS)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    tokens_alone = sync.generate([[5, 6, 7]], params)[0].token_ids
    engine = make_engine(tiny)
    steps, forwards = [0], []
    step, forward = engine.step, engine.embedder.forward

    def counting_step():
        steps[0] += 1
        return step()

    def recording_forward(*args):
        forwards.append(steps[0])
        return forward(*args)

    engine.step, engine.embedder.forward = counting_step, recording_forward

    async def main():
        async_engine = AsyncEngine(engine, warmup=False)
        async_engine.start()
        assert await async_engine.wait_ready()
        first = asyncio.Event()

        async def generate() -> list[int]:
            token_ids: list[int] = []
            async for out in async_engine.generate([5, 6, 7], params):
                first.set()
                token_ids = out.output.token_ids
            return token_ids

        generation = asyncio.create_task(generate())
        await first.wait()  # generation is running: the forwards take turns with its steps
        result = await async_engine.embed(INPUTS, PARAMS)
        tokens = await generation
        with pytest.raises(ValueError, match=r"inputs\[1\] is empty"):
            await async_engine.embed([[1], []], PARAMS)
        with pytest.raises(ValueError, match="dimensions is 65"):
            await async_engine.embed([[1]], EmbeddingParams(dimensions=65))
        await async_engine.shutdown(drain=False)
        return result, tokens

    result, tokens = asyncio.run(asyncio.wait_for(main(), 60))
    assert result.num_tokens == expected.num_tokens
    torch.testing.assert_close(torch.tensor(result.embeddings), torch.tensor(expected.embeddings))
    assert tokens == tokens_alone
    assert len(forwards) == len(engine.embedder.batches(INPUTS)) == 4
    assert all(b > a for a, b in zip(forwards, forwards[1:])), f"a step between forwards: {forwards}"
    assert engine.kv_manager.num_free_blocks == 64


def test_pending_embed_fails_at_shutdown(tiny):
    engine = make_engine(tiny)
    gate = asyncio.Event()

    async def main():
        async_engine = AsyncEngine(engine, warmup=False)
        async_engine.start()
        assert await async_engine.wait_ready()
        loop = asyncio.get_running_loop()
        forward = engine.embedder.forward

        def slow_forward(*args):  # the first forward waits until shutdown has begun
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)
            return forward(*args)

        engine.embedder.forward = slow_forward
        pending = asyncio.create_task(async_engine.embed(INPUTS, PARAMS))
        await asyncio.sleep(0.05)
        shutdown = asyncio.create_task(async_engine.shutdown(drain=False))
        await asyncio.sleep(0.05)
        gate.set()
        await shutdown
        with pytest.raises(EngineNotReadyError):
            await pending
        with pytest.raises(EngineNotReadyError):
            await async_engine.embed(INPUTS, PARAMS)

    asyncio.run(asyncio.wait_for(main(), 60))
