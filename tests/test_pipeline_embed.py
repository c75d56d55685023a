"""Pipeline.embed on a tiny random HF folder: its input forms, the engine's own vectors, its options passed on,
and clear errors."""

from __future__ import annotations

import pytest
import torch

from mcp2026 import EmbeddingResult, Pipeline
from mcp2026.types import EmbeddingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe(tiny_llama_dir):
    return Pipeline(model=tiny_llama_dir, dtype="fp32")


def test_input_forms_and_options(pipe):
    ids = [[5, 6, 7], [8, 9, 10, 11, 12]]
    result = pipe.embed(ids, pooling="mean", normalize=False, dimensions=32)
    assert isinstance(result, EmbeddingResult) and result.num_tokens == [3, 5] and result.total_tokens == 8
    expected = pipe.engine.embedder.embed(ids, EmbeddingParams("mean", normalize=False, dimensions=32))
    assert result == expected
    one = pipe.embed(ids[1])  # one token-id list: one input
    assert len(one.embeddings) == 1 and one.num_tokens == [5]
    vector = torch.tensor(one.embeddings[0])
    torch.testing.assert_close(vector.norm(), torch.tensor(1.0))  # normalised by default
    batched = torch.tensor(pipe.embed(ids).embeddings[1])
    torch.testing.assert_close(vector, batched, atol=1e-5, rtol=1e-5)  # alone as in a batch


def test_errors(pipe):
    with pytest.raises(ValueError, match="EmbeddingParams.pooling must be one of"):
        pipe.embed([[1, 2]], pooling="cls")
    with pytest.raises(ValueError, match="dimensions is 65 but this model's embeddings have 64"):
        pipe.embed([[1, 2]], dimensions=65)
    with pytest.raises(ValueError, match="no tokenizer"):
        pipe.embed("text")  # the tiny folder has none
    with pytest.raises(ValueError, match="no inputs"):
        pipe.embed([])
