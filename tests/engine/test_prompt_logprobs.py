"""Prompt logprobs: each prompt token's logprob given the ones before it, against transformers' logits, the
same whether the prompt runs in one chunk or many, and never served from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import load_model
from mcp2026.types import SamplingParams

from conftest import hf_logits, save_tiny_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("tiny_prompt_logprobs"), max_position_embeddings=256)


def run(folder, prompts: list[list[int]], params: SamplingParams, **sched) -> list:
    loaded = load_model(folder)
    config = EngineConfig(KVConfig(block_size=16, num_blocks=64), SchedulerConfig(**sched))
    engine = LLMEngine(loaded.model, loaded.config, None, config)
    finals = {}
    for prompt in prompts:  # one after another: a later prompt may find the earlier one's blocks cached
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert finals[rid].output.prompt_logprobs is not None
    assert engine.kv_manager.num_free_blocks == 64
    return [finals[r].output.prompt_logprobs for r in sorted(finals, key=lambda r: int(r.split("-")[1]))]


def test_prompt_logprobs_match_transformers(folder):
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = torch.log_softmax(hf_logits(folder, torch.tensor(prompt)), dim=-1)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    whole, chunked = (
        run(folder, [prompt], params)[0],
        run(folder, [prompt], params, max_num_batched_tokens=17)[0],
    )
    for got in (whole, chunked):
        assert len(got) == len(prompt) and got[0] is None
        for i, entry in enumerate(got[1:], start=1):
            assert entry.token_id == prompt[i]
            assert entry.logprob == pytest.approx(expected[i - 1, prompt[i]].item(), abs=1e-4)
            top = expected[i - 1].topk(3)
            assert list(entry.top) == top.indices.tolist()
            assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_bypass_the_prefix_cache(folder):
    prompt = list(range(10, 60))  # three full blocks: a second run would otherwise hit them
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    first, second = run(folder, [prompt, prompt], params)
    assert [e and (e.token_id, round(e.logprob, 5), e.top) for e in first] == [
        e and (e.token_id, round(e.logprob, 5), e.top) for e in second
    ]
    assert first[1].top == {}


def test_bad_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
