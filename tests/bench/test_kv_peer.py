"""llama.cpp's KV cache types in `bench kv`: each type's logits are scored against llama.cpp's own f16 cache on
the same tokens, with the type passed to llama.cpp as its ggml id. llama-cpp-python is not a dependency, so a
stand-in ``Llama`` returns logits made per cache type; the scoring, pooling and report are ours."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mcp2026.bench.kv_peer as kv_peer
from mcp2026.bench.peers import PeerUnavailable
from mcp2026.bench.quality import QualityAccumulator

VOCAB = 40


class FakeLlama:
    """Row i's logits peak at token i + 1 (the next token, as llama.cpp's rows do), plus noise that grows
    with the cache type's loss: a row read one position off would change the perplexity a lot."""

    made: list[dict] = []

    def __init__(self, **options) -> None:
        FakeLlama.made.append(options)
        self.noise = {1: 0.0, 8: 0.05, 2: 0.5}[options["type_k"]]
        self.scores = np.zeros((options["n_ctx"], VOCAB), dtype=np.float32)
        self.num_evals = 0

    def reset(self) -> None:
        self.scores[:] = np.nan  # a row eval does not write is no logit

    def eval(self, tokens) -> None:
        n = len(tokens)
        base = np.random.default_rng(self.num_evals).normal(size=(n, VOCAB))
        base[np.arange(n - 1), tokens[1:]] += 4.0
        noise = np.random.default_rng(100 + int(self.noise * 100)).normal(size=base.shape) * self.noise
        self.scores[:n] = base + noise
        self.num_evals += 1

    def close(self) -> None:
        pass


@pytest.fixture
def fake(monkeypatch):
    FakeLlama.made = []
    monkeypatch.setattr(kv_peer, "load_llama_cpp", lambda model, **options: FakeLlama(**options))


def test_each_type_against_the_f16_cache(fake):
    gen = torch.Generator().manual_seed(1)
    sequences = [[int(t) for t in torch.randint(VOCAB, (n,), generator=gen)] for n in (300, 260)]
    out = kv_peer.llama_cpp_kv_quality(None, sequences, prompt_len=150, types=("q8_0", "q4_0"))
    # one llama.cpp per cache type (the f16 reference first), flash attention on (quantized V needs it),
    # every logit kept, room for the longest sequence
    assert [(m["type_k"], m["type_v"]) for m in FakeLlama.made] == [(1, 1), (8, 8), (2, 2)]
    assert all(m["flash_attn"] and m["logits_all"] and m["n_ctx"] == 300 for m in FakeLlama.made)
    (q8, q8b), (q4, q4b) = out["q8_0"], out["q4_0"]
    assert (
        q8.num_tokens == q4.num_tokens == 299
        and q8b.num_tokens == q4b.num_tokens == 259
        and q8.num_tokens_after_prompt == 149
    )
    assert 0 < q8.kld < q4.kld  # more noise, further from f16
    assert q8.reference_ppl < 10  # the rows were read at their own positions: each peaks at its next token
    # the same numbers as scoring the whole first sequence at once (the chunks add up)
    whole = QualityAccumulator(sequences[0], 1, 150)
    r, t = FakeLlama(type_k=1, n_ctx=300), FakeLlama(type_k=2, n_ctx=300)
    r.eval(sequences[0]), t.eval(sequences[0])
    whole.add(0, torch.from_numpy(r.scores), [torch.from_numpy(t.scores)])
    (expected,) = whole.results()
    assert q4.kld == pytest.approx(expected.kld) and q4.ppl == pytest.approx(expected.ppl)
    assert kv_peer.kv_type_bytes_ratio("q4_0") == pytest.approx(16 / 4.5)


def test_unknown_types_and_a_missing_peer(monkeypatch):
    with pytest.raises(ValueError, match="unknown llama.cpp KV types"):
        kv_peer.llama_cpp_kv_quality(None, [[1, 2, 3]], 1, ("q3_k",))

    def missing(model, **options):
        raise PeerUnavailable("llama.cpp peer skipped: llama-cpp-python is not installed")

    monkeypatch.setattr(kv_peer, "load_llama_cpp", missing)
    with pytest.raises(PeerUnavailable):
        kv_peer.llama_cpp_kv_quality(None, [[1, 2, 3]], 1, ("q8_0",))
