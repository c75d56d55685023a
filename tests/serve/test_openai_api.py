"""The official openai client against a live server: models, completions, chat, streaming, n, logprobs."""

from __future__ import annotations

import pytest
from serve_helpers import live_server, openai_client

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def live():
    with live_server() as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live.url, timeout=30) as c:
        yield c


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_stream_equals_non_stream(client, live):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, extra_body=NO_EOS)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    live.wait_blocks_back()


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert all(c.usage is None for c in chunks)


def test_n_choices_with_seed_are_reproducible(client):
    kw = dict(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=6, temperature=1.0, n=3, seed=7, extra_body=NO_EOS)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice has its own seed
    assert first.usage.completion_tokens == 18 and first.usage.prompt_tokens == 4
    streamed = list(client.completions.create(**kw, stream=True))
    by_index = {i: "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in range(3)}
    assert [by_index[i] for i in range(3)] == [c.text for c in first.choices]


def test_batch_of_prompts(client):
    out = client.completions.create(
        model=MODEL, prompt=["Hello", "World"], max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(
        model=MODEL, prompt="World", max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert out.choices[1].text == single.choices[0].text


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    # Greedy: the sampled token is the most likely one.
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_stop_string_cuts_text(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body=NO_EOS)
    text = client.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    out = client.completions.create(**kw, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(**kw, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Echo me")
