"""The real default model (SmolLM2-135M-Instruct GGUF) against HF transformers reading the same GGUF file.

Both models get the same token ids (our tokenizer and chat template): transformers' GGUF tokenizer differs
from the reference tokenizer.json on whitespace and digits, so it is not compared here; our tokenizer's ids
are pinned in tests/loading/test_tokenizer.py.
"""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import LoadedModel, load_model
from mcp2026.types import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Add 12345 and 67890, then divide 3.1415 by 2. Show each step: 1), 2), 3).",
    "Indent this:\n\ndef f(x):\n        return   x  *\t2\n\n\n   # done   ",
]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def hf(default_model_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(ours) -> list[list[int]]:
    return [ours.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def test_next_token_logits_match(ours, hf, prompt_ids, record_property):
    max_diffs = []
    for ids in prompt_ids:
        x = torch.tensor(ids)
        with torch.no_grad():
            logits = ours.model.compute_logits(ours.model(x, torch.arange(len(ids))))  # (T, V)
            ref = hf(x[None]).logits[0].float()  # (T, V)
        max_diffs.append((logits - ref).abs().max().item())
        assert logits[-1].argmax().item() == ref[-1].argmax().item()
    record_property("max_abs_logit_diff", max(max_diffs))
    print("max abs logit diff per prompt:", ", ".join(f"{d:.2e}" for d in max_diffs))
    assert max(max_diffs) < 1e-3


def test_greedy_continuations_match(ours, hf, prompt_ids):
    engine = LLMEngine(ours.model, ours.config, ours.tokenizer, EngineConfig(KVConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = engine.generate(prompt_ids, params)
    for ids, out in zip(prompt_ids, outputs):
        # eos_token_id=None: generate neither stops at nor suppresses <|im_end|>, which is what ignore_eos means
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        assert len(out.token_ids) == NUM_NEW_TOKENS
        assert out.token_ids == ref, ours.tokenizer.decode(out.token_ids, skip_special_tokens=False)
    assert any(2 in o.token_ids for o in outputs)  # at least one continuation ran past <|im_end|>
