"""Hardened HTTP and the per-request fields that reach the sampler and the prefix cache: the body limit (413),
TLS end to end with a real certificate chain, logit_bias, cache_salt."""

from __future__ import annotations

import ssl

import httpx
import openai
import pytest
from serve_helpers import MODEL, live_server, openai_client

from mcp2026.serve.config import ServeConfig

LIMIT = 4096


@pytest.fixture(scope="module")
def live():
    with live_server(ServeConfig(model_name=MODEL, max_request_body_bytes=LIMIT)) as server:
        yield server


def _assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert "max_request_body_bytes" in error["message"] and str(LIMIT) in error["message"]
    assert r.headers["x-request-id"]


def test_body_over_the_limit_is_413(live):
    url = f"{live.url}/v1/completions"
    big = {"model": MODEL, "prompt": "x" * LIMIT, "max_tokens": 1}
    _assert_413(httpx.post(url, json=big))  # Content-Length says so: refused before reading

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // 512 + 1):
            yield b"y" * 512
        yield b'", "max_tokens": 1}'

    _assert_413(httpx.post(url, content=chunks(), headers={"content-type": "application/json"}))
    small = {"model": MODEL, "prompt": "Hi", "user": "u" * (LIMIT // 2), "max_tokens": 1}
    assert httpx.post(url, json=small).status_code == 200
    live.wait_blocks_back()


def test_bad_limit_is_refused():
    with pytest.raises(ValueError, match="max_request_body_bytes"):
        ServeConfig(max_request_body_bytes=0)


def test_logit_bias_reaches_the_sampler(live):
    client = openai_client(live.url)

    def text(bias: dict[str, float], temperature: float) -> str:
        out = client.completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=temperature, seed=3, logit_bias=bias
        )
        return out.choices[0].text

    def detok(ids: list[int]) -> str:
        return httpx.post(f"{live.url}/detokenize", json={"tokens": ids}).json()["prompt"]

    assert text({"42": 100}, 1.0) == detok([42, 42, 42])
    assert text({"42": 100, "43": 100, "44": -100}, 0.0) in {detok(ids) for ids in _mixes(42, 43)}
    live.wait_blocks_back()


def _mixes(a: int, b: int) -> list[list[int]]:
    return [[x, y, z] for x in (a, b) for y in (a, b) for z in (a, b)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"49152": 1}),  # the vocabulary has 49152 tokens
        ("stop_token_ids", [49152]),
        ("cache_salt", ""),
    ],
)
def test_bad_bias_ids_and_salt_are_400(live, field, value):
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field)


def test_cache_salt_isolates_prefix_reuse(live):
    prompt = list(range(100, 180))  # five full blocks of 16

    def cached(salt: str | None) -> int:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        usage = httpx.post(f"{live.url}/v1/completions", json=body).json()["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    cached(None)
    assert cached(None) > 0  # the same prompt again reuses its blocks
    assert cached("alice") == 0  # a salted request does not see the unsalted blocks
    assert cached("alice") > 0  # ... but sees its own
    assert cached("bob") == 0
    live.wait_blocks_back()


def test_tls_end_to_end_with_the_openai_client(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = tmp_path / "server.pem", tmp_path / "server.key"
    cert.private_key_pem.write_to_path(keyfile)
    certfile.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))  # leaf first, then the chain
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    config = ServeConfig(model_name=MODEL, ssl_certfile=str(certfile), ssl_keyfile=str(keyfile))
    with live_server(config, verify=client_ctx) as server:
        assert server.url.startswith("https://")
        client = openai.OpenAI(
            base_url=f"{server.url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.Client(verify=client_ctx, timeout=30),
        )
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert out.choices[0].finish_reason in ("length", "stop")
        client.close()
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA refuses the server
            httpx.get(f"{server.url}/healthz", timeout=5)
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP to the TLS port is not answered
            httpx.get(server.url.replace("https://", "http://") + "/healthz", timeout=5)
        server.wait_blocks_back()


def test_best_of_returns_the_most_likely_per_token(live):
    client = openai_client(live.url)
    common = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 1.0, "seed": 11}
    every = client.completions.create(**common, n=4, logprobs=0, extra_body={"ignore_eos": True})
    mean = [sum(c.logprobs.token_logprobs) / 4 for c in every.choices]  # choice i is seeded seed + i
    ranked = sorted(range(4), key=lambda i: -mean[i])
    best = client.completions.create(**common, n=2, best_of=4, extra_body={"ignore_eos": True})
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 16  # every generated token counts
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}):
        r = httpx.post(f"{live.url}/v1/completions", json={**common, **bad})
        assert r.status_code == 400 and "best_of" in r.json()["error"]["message"], r.text
    live.wait_blocks_back()


def test_echo_with_logprobs_scores_the_prompt(live):
    client = openai_client(live.url)
    prompt = [5, 6, 7, 8, 9, 10]
    common = {"model": MODEL, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    whole = client.completions.create(prompt=prompt, **common).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    longer = client.completions.create(prompt=[*prompt, 11, 12], **common).choices[0].logprobs
    assert longer.token_logprobs[0] is None  # causal: the shared prefix scores the same (up to batch shape)
    assert longer.token_logprobs[1 : len(prompt)] == pytest.approx(
        lp.token_logprobs[1 : len(prompt)], abs=1e-4
    )
    chunks = list(client.completions.create(prompt=prompt, stream=True, **common))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert chunks[0].choices[0].text.startswith(whole.text[: len(whole.text) - len(lp.tokens[-1])])
    live.wait_blocks_back()


def test_unknown_fields_are_named_in_a_header(live):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "frobnicate": 1, "zeta": {}, "bad\nname": 2}
    r = httpx.post(f"{live.url}/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "?, frobnicate, zeta"
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}) as s:
        assert s.headers["x-ignored-fields"] == "?, frobnicate, zeta"
        s.read()
    plain = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert "x-ignored-fields" not in plain.headers
    live.wait_blocks_back()
