"""POST /v1/embeddings with the official openai client against a live server: every input form, float and
base64 equal to the engine's own embeddings, the pooling and normalize extensions, 400s naming the field,
generation running beside it undisturbed, and (slow) equality with Pipeline.embed on the default model."""

from __future__ import annotations

import base64
import re
import threading

import httpx
import numpy as np
import openai
import pytest
from serve_helpers import live_server, openai_client, smol_tokenizer

from mcp2026.serve.config import ServeConfig
from mcp2026.types import EmbeddingParams

MODEL = "tiny"
MAX_INPUTS = 8
TEXTS = ["Hello world", "The capital of France is Paris.", "embeddings"]


@pytest.fixture(scope="module")
def live():
    with live_server(ServeConfig(model_name=MODEL, max_embedding_inputs=MAX_INPUTS)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live.url, timeout=30) as c:
        yield c


def engine_vectors(live, inputs, **params) -> np.ndarray:
    """What the served engine's embedder gives for the same inputs (the server is idle meanwhile)."""
    return np.array(live.engine.embedder.embed(inputs, EmbeddingParams(**params)).embeddings)


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    return np.array([d.embedding for d in response.data])


def test_float_and_base64_equal_the_engine(client, live):
    token_lists = [smol_tokenizer().encode(t) for t in TEXTS]
    expected = engine_vectors(live, token_lists)
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == MODEL
    num_tokens = sum(len(t) for t in token_lists)
    assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens
    np.testing.assert_allclose(vectors(out), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(vectors(out), axis=1), 1.0, rtol=1e-5)
    # the client asks for base64 unless told otherwise and decodes it itself
    np.testing.assert_allclose(
        vectors(client.embeddings.create(model=MODEL, input=TEXTS)), expected, rtol=1e-6
    )
    raw = httpx.post(f"{live.url}/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_array_equal(np.array(decoded), expected.astype(np.float32))
    live.wait_blocks_back()


def test_input_forms(client, live):
    ids = smol_tokenizer().encode(TEXTS[1])
    one_text = vectors(client.embeddings.create(model=MODEL, input=TEXTS[1]))
    one_ids = vectors(client.embeddings.create(model=MODEL, input=ids))
    many_ids = vectors(client.embeddings.create(model=MODEL, input=[[5, 6, 7], ids]))
    np.testing.assert_allclose(one_text, one_ids, rtol=1e-6)
    np.testing.assert_allclose(many_ids[1], one_ids[0], rtol=1e-5, atol=1e-6)  # batched as alone
    np.testing.assert_allclose(many_ids[0], engine_vectors(live, [[5, 6, 7]])[0], rtol=1e-5, atol=1e-6)


def test_dimensions_pooling_and_normalize(client, live):
    ids = [[5, 6, 7, 8], list(range(100, 140))]
    raw_mean = engine_vectors(live, ids, pooling="mean", normalize=False)
    mean = client.embeddings.create(
        model=MODEL, input=ids, extra_body={"pooling": "mean", "normalize": False}
    )
    np.testing.assert_allclose(vectors(mean), raw_mean, rtol=1e-5, atol=1e-6)
    short = vectors(client.embeddings.create(model=MODEL, input=ids, dimensions=16))
    last = engine_vectors(live, ids, normalize=False)  # "last" is the server's default pooling
    truncated = last[:, :16] / np.linalg.norm(last[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, truncated, rtol=1e-5, atol=1e-6)
    assert not np.allclose(raw_mean[:, :16], last[:, :16])  # the two poolings differ


def test_the_config_picks_the_pooling():
    with live_server(ServeConfig(model_name=MODEL, embedding_pooling="mean")) as server:
        out = httpx.post(f"{server.url}/v1/embeddings", json={"input": [[5, 6, 7, 8]]}).json()
        expected = engine_vectors(server, [[5, 6, 7, 8]], pooling="mean")
    np.testing.assert_allclose(out["data"][0]["embedding"], expected[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ServeConfig.embedding_pooling must be one of"):
        ServeConfig(embedding_pooling="cls")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": []}, "input", "empty list"),
        ({"input": [[]]}, "input", "empty"),
        ({"input": ["a", ""]}, "input", "empty"),
        ({"input": [[1, 2]] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
        ({"input": [[1] * 513]}, "input", "maximum context length is 512"),
        ({"input": [[1, 2], [49152]]}, "input", r"input\[1\]: token ids must be in \[0, 49152\)"),
        ({"input": [-1]}, "input", "holds -1, not a token id"),
        ({"input": [["a"]]}, "input", r"input\[0\] holds 'a', not a token id"),
        ({"input": ["a", [1]]}, "input", "not a token id"),
        ({"input": 5}, "input", "a string or a non-empty list"),
        ({"input": "hi", "dimensions": 65}, "dimensions", "at most 64"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "hi", "pooling": "cls"}, "pooling", "last"),
        ({}, "input", "required"),
    ],
)
def test_bad_requests_name_the_field(live, body, param, message):
    response = httpx.post(f"{live.url}/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].split(".")[0] == param, error
    assert re.search(message, error["message"]), error


def test_errors_through_the_client(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.embeddings.create(model=MODEL, input=[[1] * 600])


def test_generation_beside_embeddings_is_undisturbed(client, live):
    """A completion streamed while embeddings run between its steps gives the tokens it gives alone."""
    kw = dict(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    alone = client.completions.create(**kw).choices[0].text
    results = {}
    thread = threading.Thread(target=lambda: results.setdefault("text", client.completions.create(**kw)))
    thread.start()
    for _ in range(5):
        client.embeddings.create(model=MODEL, input=[list(range(10, 200))] * MAX_INPUTS)
    thread.join(60)
    assert results["text"].choices[0].text == alone
    live.wait_blocks_back()


@pytest.mark.slow
def test_equals_pipeline_embed_on_the_default_model():
    from mcp2026 import Pipeline

    pipe = Pipeline()
    with (
        live_server(ServeConfig(model_name=MODEL), engine=pipe.engine) as server,
        openai_client(server.url) as c,
    ):
        served = vectors(c.embeddings.create(model=MODEL, input=TEXTS, extra_body={"pooling": "mean"}))
    expected = pipe.embed(TEXTS, pooling="mean")
    assert expected.num_tokens == [len(pipe.tokenizer.encode(t)) for t in TEXTS]
    np.testing.assert_allclose(served, np.array(expected.embeddings), rtol=1e-5, atol=1e-6)
    assert served.shape == (len(TEXTS), pipe.loaded.config.hidden_size)
