"""RoPE scalings against HF transformers: tiny random Llamas whose original context is 16 positions, run over 40,
so every scaling acts. Each test also runs the same weights with plain RoPE and requires the logits to move
(by 10x the tolerance: a test that would pass with the scaling ignored checks nothing)."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model
from mcp2026.models.rotary import RotaryEmbedding

from conftest import save_tiny_hf

TOKENS, ORIGINAL, PREFILL = 40, 16, 8
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-explicit": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "attention_factor": 1.3,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": False,
        "rope_theta": 100.0,  # puts the ramp's end between two dimensions, so truncating it would show
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "rope_theta": 100.0,
    },
}


def ids() -> torch.Tensor:
    return torch.randint(0, 320, (TOKENS,), generator=torch.Generator().manual_seed(1))


def our_logits(loaded, tokens: torch.Tensor, unscaled: bool = False) -> torch.Tensor:
    """Our logits for one pass over ``tokens``; ``unscaled``: the same weights with plain RoPE."""
    model, c = loaded.model, loaded.config
    scaled = model.rope
    if unscaled:
        model.rope = RotaryEmbedding(c.head_dim, model.max_positions, c.rope_theta, None)
    try:
        with torch.no_grad():
            return model.compute_logits(model(tokens, torch.arange(len(tokens))))
    finally:
        model.rope = scaled


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_token_by_token(path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for a prefill of PREFILL tokens, then one token at a time through its cache."""
    from transformers import DynamicCache

    model, cache = hf_model(path), DynamicCache()
    with torch.no_grad():
        rows = [model(tokens[None, :PREFILL], cache=cache, use_cache=True).logits[0]]
        for p in range(PREFILL, len(tokens)):
            rows.append(model(tokens[None, p : p + 1], cache=cache, use_cache=True).logits[0])
    return torch.cat(rows)


def assert_matches_and_matters(loaded, ref: torch.Tensor, tokens: torch.Tensor) -> None:
    assert (our_logits(loaded, tokens) - ref).abs().max().item() < 1e-4
    assert (our_logits(loaded, tokens, unscaled=True) - ref).abs().max().item() > 1e-3  # 10x the tolerance


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_matches_hf_past_the_original_context(tmp_path, name):
    path = save_tiny_hf(tmp_path, rope_scaling=dict(SCALINGS[name]))
    tokens = ids()
    with torch.no_grad():
        ref = hf_model(path)(tokens[None]).logits[0]
    assert_matches_and_matters(load_model(path, dtype=torch.float32), ref, tokens)


def test_dynamic_ntk_matches_hf_decoding_token_by_token(tmp_path):
    """transformers' dynamic NTK counts from max_position_embeddings and recomputes its base from the current
    length; decoding one token at a time past it, each new token's q and k use the base of length p + 1, which
    is our per-position table."""
    path = save_tiny_hf(
        tmp_path, max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
    )
    loaded = load_model(path, dtype=torch.float32)
    assert loaded.config.max_position_embeddings == 4 * ORIGINAL  # the context dynamic NTK extends to
    tokens = ids()
    with torch.no_grad():
        # a fresh model per use: transformers keeps the last base it grew to (a 16-token pass after 40 tokens
        # still uses the base for 40), so its results also depend on what the same instance ran before
        within = hf_model(path)(tokens[None, :ORIGINAL]).logits[0]
        one_pass = hf_model(path)(tokens[None]).logits[0]
    ref = hf_token_by_token(path, tokens)
    assert_matches_and_matters(loaded, ref, tokens)
    ours = our_logits(loaded, tokens)
    # A context within the original length is plain RoPE in both. Where ours and transformers part: one forward
    # pass longer than that rotates every position with the base of the whole length (docs/architecture.md).
    assert (ours[:ORIGINAL] - within).abs().max().item() < 1e-4
    assert (ours - one_pass).abs().max().item() > 1e-4  # past the match tolerance


@pytest.mark.parametrize("name", ["yarn-explicit", "dynamic"])
def test_paged_decode_steps_read_the_scaled_tables(tmp_path, name):
    """The engine's path: a prefill, then one token per step through the paged KV cache (decode-sized steps run
    the fused CPU layers where they are built), against transformers decoding the same way."""
    from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
    from mcp2026.engine.engine import LLMEngine

    if name == "dynamic":
        path = save_tiny_hf(
            tmp_path, max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
        )
    else:
        path = save_tiny_hf(tmp_path, rope_scaling=dict(SCALINGS[name]))
    loaded, tokens = load_model(path, dtype=torch.float32), ids()
    engine = LLMEngine(
        loaded.model,
        loaded.config,
        None,
        EngineConfig(KVConfig(block_size=16, num_blocks=8), SchedulerConfig()),
    )
    with torch.no_grad():
        chunks = list(engine.score(tokens.tolist(), prompt_len=PREFILL, chunk_size=1))
    logits = torch.cat([c.logits for c in sorted(chunks, key=lambda c: c.start)])
    assert (logits - hf_token_by_token(path, tokens)).abs().max().item() < 1e-4
