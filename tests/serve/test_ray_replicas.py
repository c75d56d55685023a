"""Two engine replicas of a tiny random model on a local Ray cluster, behind the prefix-aware ingress: the
OpenAI API through it (the official client, streaming too), and a multi-turn workload's prefix-cache hit rate
(read from the replicas' engine counters) routed by prefix against one replica and against random routing."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from serve_helpers import free_port, openai_client, smol_tokenizer

from conftest import save_tiny_hf

ray = pytest.importorskip("ray", reason="needs Ray Serve (pip install 'mcp2026[ray]')")
serve = pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'mcp2026[ray]')")

from mcp2026.serve.ray_ingress import build_app  # noqa: E402 - after the skip when Ray is missing
from mcp2026.serve.ray_replica import ForwardedRequest, ResponseHead  # noqa: E402

BLOCK = 16
KEY = "sk-alpha"
APP = "mcp2026"


def save_model(folder) -> None:
    """The tiny random Llama with the SmolLM2 vocabulary, tokenizer and chat template: a folder each replica
    loads itself (Ray pickles the deployment, not the model)."""
    save_tiny_hf(folder, vocab_size=49152, max_position_embeddings=512)
    tokenizer = smol_tokenizer()
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    eos = list(tokenizer.eos_token_ids)
    token = tokenizer.backend.id_to_token
    config = {
        "bos_token": tokenizer.bos_token,
        "eos_token": token(eos[0]),
        "add_bos_token": tokenizer.add_bos,
    }
    config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    save_model(root / "tiny")
    (root / "tenants.yaml").write_text(
        "tenants:\n  - {name: alpha, api_keys: [sk-alpha]}\n  - {name: beta, api_keys: [sk-beta], weight: 2}\n"
    )
    (root / "serve.yaml").write_text(
        "model: tiny\nmodel_name: tiny\ndtype: fp32\ntenants: tenants.yaml\nmax_request_body_bytes: 65536\n"
        f"kv: {{block_size: {BLOCK}, num_blocks: 2048}}\n"
    )
    started = time.monotonic()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = {"ray_actor_options": {"num_cpus": 0}}
    app = build_app(
        {
            "config": str(root / "serve.yaml"),
            "replicas": 2,
            "replica_options": options,
            "router_options": options,
        }
    )
    ingress = serve.run(app, name=APP, route_prefix="/")
    assert ingress.ready.remote(120).result()
    print(f"Ray, 2 replicas and the ingress ready in {time.monotonic() - started:.1f} s")
    try:
        yield f"http://127.0.0.1:{port}", ingress
    finally:
        serve.shutdown()
        ray.shutdown()


def test_openai_api_through_the_ingress(cluster):
    url, ingress = cluster
    client = openai_client(url)
    client.api_key = KEY
    no_eos = {"ignore_eos": True}  # a sampled end of sequence would end a request before its max_tokens
    completion = client.completions.create(
        model="tiny", prompt="The capital of France is", max_tokens=5, extra_body=no_eos
    )
    assert completion.usage.completion_tokens == 5 and completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, extra_body=no_eos
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    # Streamed tokens are counted by the usage chunk: a token whose text the detokenizer holds back, or one
    # drafted beside another in one step, adds no chunk of its own.
    usage = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            stream=True,
            stream_options=usage,
            extra_body=no_eos,
        )
    )
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    streamed = list(
        client.completions.create(
            model="tiny", prompt="One two", max_tokens=3, stream=True, stream_options=usage, extra_body=no_eos
        )
    )
    assert streamed[-1].usage.completion_tokens == 3 and streamed[-2].choices[0].finish_reason == "length"
    refused = httpx.post(
        f"{url}/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer no"}
    )
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    too_large = httpx.post(
        f"{url}/v1/completions", content=b"x" * 65537, headers={"authorization": f"Bearer {KEY}"}
    )
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    assert (
        httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
        == "tiny"
    )
    routes = ingress.routes.remote().result()
    assert set(routes) >= {"engine-0/balance", "engine-1/balance"}  # new prefixes spread over both replicas


def test_a_client_leaving_mid_stream_aborts_on_its_replica(cluster):
    url, ingress = cluster
    body = {"model": "tiny", "prompt": [5] * 20, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30
    ) as response:
        replica = response.headers["x-mcp2026-replica"]
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    handle = serve.get_deployment_handle(replica, APP)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        report = ingress.reports.remote().result()[replica]
        if report.num_waiting + report.num_running == 0:
            break
        time.sleep(0.1)
    assert report.num_waiting + report.num_running == 0
    _, metrics = call(handle, "GET", "/metrics")
    assert 'status="abort"' in metrics.decode(), "the request ran to its end instead of being aborted"


def conversations(seed: int, num: int = 12, num_turns: int = 5) -> list[list[list[int]]]:
    """Token-id prompts, turn by turn: every turn repeats the previous ones and adds 2-4 blocks."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        prompt: list[int] = []
        turns = []
        for _ in range(num_turns):
            prompt = prompt + [rng.randrange(100, 49_000) for _ in range(rng.randrange(2 * BLOCK, 4 * BLOCK))]
            turns.append(prompt)
        out.append(turns)
    return out


def call(handle, method: str, path: str, body: dict | None = None) -> tuple[ResponseHead, bytes]:
    """One request sent straight to a replica's handle, skipping the router."""
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]
    data = b"" if body is None else json.dumps(body).encode()
    items = list(
        handle.options(stream=True).handle_http.remote(ForwardedRequest(method, path, b"", headers, data))
    )
    assert isinstance(items[0], ResponseHead), items
    return items[0], b"".join(items[1:])


def forward(handle, prompt: list[int]) -> None:
    head, body = call(handle, "POST", "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert head.status == 200, body


def hit_rate(ingress, send, convs) -> float:
    """Share of the prompts' full blocks the chosen replicas found cached, from their engines' counters."""
    before = ingress.reports.remote().result()
    for turn in range(len(convs[0])):  # turns interleaved across conversations, as live traffic is
        for conv in convs:
            send(conv[turn])
    after = ingress.reports.remote().result()
    hits = sum(after[n].num_prefix_hit_blocks - before[n].num_prefix_hit_blocks for n in after)
    queries = sum(after[n].num_prefix_query_blocks - before[n].num_prefix_query_blocks for n in after)
    return hits / queries


def test_prefix_routing_keeps_a_single_replicas_hit_rate(cluster):
    url, ingress = cluster
    handles = [serve.get_deployment_handle(f"engine-{i}", APP) for i in range(2)]
    http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=30)

    def routed(prompt: list[int]) -> None:
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text

    rng = random.Random(0)
    single = hit_rate(ingress, lambda p: forward(handles[0], p), conversations(1))
    prefix = hit_rate(ingress, routed, conversations(2))
    scattered = hit_rate(ingress, lambda p: forward(handles[rng.randrange(2)], p), conversations(3))
    print(f"hit rate: one replica {single:.3f}, prefix-routed {prefix:.3f}, random {scattered:.3f}")
    assert single > 0.6  # the workload does reuse its prefixes
    assert prefix >= 0.9 * single
    assert scattered < 0.8 * single
    routes = ingress.routes.remote().result()
    assert routes.get("engine-0/prefix", 0) > 0 and routes.get("engine-1/prefix", 0) > 0
