"""Embeddings against transformers' final hidden states on tiny random models: last and mean pooling, batched
equal to one at a time, normalisation and Matryoshka truncation, bad inputs refused, and running generation
requests undisturbed (no blocks taken, same tokens)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.embedding import plan_batches
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import load_model
from mcp2026.types import EmbeddingParams, SamplingParams

from conftest import save_tiny_hf

ATOL = 2e-4  # fp32 engine vs fp32 transformers
MODELS = {
    "llama": dict(),
    "mistral": dict(arch="mistral", sliding_window=12),  # windows shorter than the longer inputs
    "gemma3": dict(
        arch="gemma3", num_hidden_layers=3, sliding_window=12,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}  # fmt: skip
LENGTHS = (5, 1, 40, 17, 23)  # 86 tokens: past the fused decode-sized layer path's row limit

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    path = save_tiny_hf(tmp_path_factory.mktemp(f"embed_{request.param}"), **MODELS[request.param])
    return path, load_model(path)


@functools.cache
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_hidden(path, ids: list[int]) -> torch.Tensor:
    """transformers' last entry of ``hidden_states`` (T, H), checked to be the final norm's output."""
    model = hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        last = out.hidden_states[-1][0]
        # after the final norm: the base model's output, and what the LM head reads
        assert torch.allclose(last, model.model(torch.tensor([ids])).last_hidden_state[0])
        assert torch.allclose(model.lm_head(last), out.logits[0], atol=1e-5)
    return last


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


INPUTS = [tokens(n, seed) for seed, n in enumerate(LENGTHS)]


def make_engine(loaded, **sched) -> LLMEngine:
    config = EngineConfig(KVConfig(block_size=16, num_blocks=32), SchedulerConfig(**sched))
    return LLMEngine(loaded.model, loaded.config, None, config)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_match_transformers(tiny, pooling):
    path, loaded = tiny
    result = make_engine(loaded).embedder.embed(INPUTS, EmbeddingParams(pooling, normalize=False))
    assert result.num_tokens == list(LENGTHS) and result.total_tokens == sum(LENGTHS)
    for ids, ours in zip(INPUTS, result.embeddings):
        hidden = hf_hidden(path, ids)
        expected = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        torch.testing.assert_close(torch.tensor(ours), expected, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_equals_one_at_a_time(tiny, pooling):
    _, loaded = tiny
    params = EmbeddingParams(pooling, normalize=False)
    engine = make_engine(loaded)
    assert len(engine.embedder.batches(INPUTS)) == 1  # one forward for all of them
    batched = torch.tensor(engine.embedder.embed(INPUTS, params).embeddings)
    alone = torch.tensor([engine.embedder.embed([ids], params).embeddings[0] for ids in INPUTS])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)
    small = make_engine(loaded, max_num_batched_tokens=32)  # 5+1 | 40 | 17 | 23: four forwards
    assert small.embedder.batches(INPUTS) == [[0, 1], [2], [3], [4]]
    torch.testing.assert_close(torch.tensor(small.embedder.embed(INPUTS, params).embeddings), batched)


def test_normalize_and_dimensions(tiny):
    _, loaded = tiny
    embedder = make_engine(loaded).embedder
    raw = torch.tensor(embedder.embed(INPUTS, EmbeddingParams("mean", normalize=False)).embeddings)
    unit = torch.tensor(embedder.embed(INPUTS, EmbeddingParams("mean")).embeddings)
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(len(INPUTS)))
    torch.testing.assert_close(unit, raw / raw.norm(dim=1, keepdim=True))
    short = torch.tensor(embedder.embed(INPUTS, EmbeddingParams("mean", dimensions=16)).embeddings)
    assert short.shape == (len(INPUTS), 16)
    torch.testing.assert_close(short, F.normalize(raw[:, :16], dim=1))  # truncated, then renormalised
    cut = embedder.embed(INPUTS, EmbeddingParams("mean", normalize=False, dimensions=16)).embeddings
    torch.testing.assert_close(torch.tensor(cut), raw[:, :16])
    whole = embedder.embed(INPUTS[:1], EmbeddingParams("mean", dimensions=loaded.config.hidden_size))
    assert len(whole.embeddings[0]) == loaded.config.hidden_size


def test_bad_inputs_are_refused(tiny):
    _, loaded = tiny
    embedder = make_engine(loaded, max_model_len=64).embedder
    cases = [
        ([[]], r"inputs\[0\] is empty"),
        ([[1, 2], [5, 320]], r"inputs\[1\]: token ids must be in \[0, 320\)"),
        ([[1, 2], [3, -1]], r"inputs\[1\]: token ids must be in"),
        ([tokens(65, 0)], "inputs.0. has 65 tokens but this model's context is 64 tokens"),
        (["text"], "no tokenizer"),
        ([{"role": "user"}], "must be a string or a list of token ids"),
        ([], "no inputs"),
    ]
    for inputs, message in cases:
        with pytest.raises(ValueError, match=message):
            embedder.embed(inputs)
    whole_context = embedder.embed([tokens(64, 0)])
    assert len(whole_context.embeddings[0]) == loaded.config.hidden_size
    with pytest.raises(ValueError, match="dimensions is 65 but this model's embeddings have 64"):
        embedder.embed([[1, 2]], EmbeddingParams(dimensions=65))
    for bad in (dict(pooling="cls"), dict(dimensions=0), dict(normalize="yes")):
        with pytest.raises(ValueError, match="EmbeddingParams"):
            EmbeddingParams(**bad)


def test_generation_undisturbed(tiny):
    """Embedding between steps of running requests takes no blocks and changes none of their tokens."""
    _, loaded = tiny
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [tokens(30, 7), tokens(9, 8)]
    expected = [o.token_ids for o in make_engine(loaded).generate(prompts, params)]
    engine = make_engine(loaded)
    ids = [engine.add_request(p, params) for p in prompts]
    done, num_steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
        num_steps += 1
        if num_steps in (1, 4):  # after the prefill, mid-decode
            free = engine.kv_manager.num_free_blocks
            engine.embedder.embed(INPUTS)
            assert engine.kv_manager.num_free_blocks == free
            engine.kv_manager.check_integrity()
    assert [done[i] for i in ids] == expected


def test_plan_batches():
    assert plan_batches([3, 3, 3], 6) == [[0, 1], [2]]
    assert plan_batches([10, 2, 2], 6) == [[0], [1, 2]]  # too long for the budget: a forward of its own
    assert plan_batches([], 6) == []
