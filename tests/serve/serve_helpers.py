"""Live servers on 127.0.0.1 for the serve tests: a tiny random Llama with the real SmolLM2 vocabulary
(so the real tokenizer and chat template work) behind uvicorn in a thread.

Not a conftest.py: a second ``conftest`` module would shadow ``tests/conftest.py`` for later imports.
Model and tokenizer are memoized per process, so each test module's fixtures share them.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig, SpeculativeConfig
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import LoadedModel, default_model_path
from mcp2026.loading.tokenizer import Tokenizer
from mcp2026.serve.app import create_app
from mcp2026.serve.config import ServeConfig
from mcp2026.serve.server import GracefulServer
from mcp2026.serve.tenants import TenantRegistry

from conftest import tiny_random_model

NUM_BLOCKS = 128
MAX_MODEL_LEN = 512
MODEL = "tiny"


@functools.cache
def smol_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@functools.cache
def tiny_vocab_model() -> LoadedModel:
    """Random weights, built directly (no transformers import): 2 layers, hidden 64, vocab 49152."""
    model, config = tiny_random_model(49152, MAX_MODEL_LEN, bos_token_id=1)
    return LoadedModel(model, config, None, Path("tiny-random"), "random")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Live:
    url: str
    engine: LLMEngine
    async_engine: AsyncEngine
    server: GracefulServer
    app: object

    def wait_blocks_back(self, timeout_s: float = 10.0) -> None:
        """Every block free (or evictable) again, and the pool consistent."""
        deadline = time.monotonic() + timeout_s
        kv = self.engine.kv_manager
        while time.monotonic() < deadline:
            if kv.num_free_blocks == NUM_BLOCKS and not self.engine.has_unfinished():
                break
            time.sleep(0.02)
        assert kv.num_free_blocks == NUM_BLOCKS, f"{NUM_BLOCKS - kv.num_free_blocks} blocks leaked"
        assert not self.engine.has_unfinished()
        kv.check_integrity()


@contextmanager
def live_server(
    config: ServeConfig | None = None,
    tenants: TenantRegistry | None = None,
    num_blocks: int = NUM_BLOCKS,
    tracing: object = None,
    engine: LLMEngine | None = None,
    verify: object = True,
    speculative: str = "ngram",
    step_delay_s: float = 0.0,
    **scheduler,
) -> Iterator[Live]:
    """``engine``: serve this engine (and its tokenizer) instead of the tiny model. ``verify``: how the
    readiness probe checks a TLS server's certificate (an ``ssl.SSLContext``). ``speculative="off"``: one token
    per step, for tests that cut requests short by the clock (drafts could finish them first).
    ``step_delay_s``: each engine step takes at least this long, so that a request of N tokens outlasts a
    client's timeout however fast the machine is."""
    if engine is None:
        engine_config = EngineConfig(
            KVConfig(block_size=16, num_blocks=num_blocks),
            SchedulerConfig(**scheduler),
            speculative=SpeculativeConfig(method=speculative),
        )
        model = tiny_vocab_model()
        engine = LLMEngine(model.model, model.config, smol_tokenizer(), engine_config)
    if step_delay_s > 0:
        step = engine.step

        def slow_step():
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step
    tokenizer = engine.tokenizer
    async_engine = AsyncEngine(engine)
    config = config or ServeConfig(model_name=MODEL)
    app = create_app(async_engine, tokenizer, config, tenants, tracing=tracing)
    port = free_port()
    tls = {"ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile}
    server = GracefulServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **tls), async_engine, config
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"{'https' if config.ssl_certfile else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1, verify=verify).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        server.should_exit = True
        raise RuntimeError("the test server did not become ready in 20 s")
    try:
        yield Live(url, engine, async_engine, server, app)
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "the test server did not stop"


def openai_client(url: str, timeout: float = 30):
    """The official openai client for a live server at ``url`` (no retries: a failure shows at once)."""
    import openai  # a dev dependency only these tests use

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
