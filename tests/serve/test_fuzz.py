"""Schemathesis against the server's own /openapi.json: generated requests (valid and invalid) never get a
5xx, and every error is in OpenAI's shape."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from serve_helpers import live_server

from mcp2026.serve.config import ServeConfig

schemathesis = pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def live():
    # A short context keeps generated max_tokens (up to 2**20) cheap.
    with live_server(ServeConfig(model_name="tiny", max_n=4), max_model_len=48) as server:
        yield server


def check_case(case) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.parametrize(
    ("path", "negative"),
    [
        ("/v1/completions", False),
        ("/v1/completions", True),
        ("/v1/chat/completions", False),
        ("/v1/chat/completions", True),
        ("/v1/embeddings", False),
        ("/v1/embeddings", True),
        ("/v1/models", False),  # no body or parameters: nothing negative to generate
        ("/tokenize", False),
        ("/tokenize", True),
        ("/detokenize", False),
        ("/detokenize", True),
    ],
)
def test_no_5xx_and_openai_errors(live, path, negative):
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    (operation,) = [op for op in operations if op.path == path]

    mode = schemathesis.GenerationMode.NEGATIVE if negative else None
    strategy = operation.as_strategy(generation_mode=mode) if negative else operation.as_strategy()

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(case=strategy)
    def fuzz(case) -> None:
        check_case(case)

    fuzz()
    live.wait_blocks_back()
