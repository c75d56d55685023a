"""GGUF q/k rows in llama.cpp's layout per family: the Llama converter permutes them for its interleaved
rotary, the Qwen2/Qwen3/Gemma 3 ones do not (llama.cpp runs those with NeoX rotary). Each file is written the
way llama.cpp's converter writes it; transformers reading the same file is the check that the layout is right."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model

from conftest import save_tiny_hf
from gguf_files import write_converted_gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_gguf_rotary_layout_matches_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    # Gemma 3 as llama.cpp runs it: every sixth layer global (here: both local), queries scaled by head_dim
    extra = {"sliding_window": 8, "query_pre_attn_scalar": 16} if arch == "gemma3" else {}
    hf_dir = save_tiny_hf(tmp_path, arch=arch, **extra)
    window = (lambda w: w.add_uint32("gemma3.attention.sliding_window", 8)) if arch == "gemma3" else None
    name = write_converted_gguf(hf_dir, arch, heads=4, kv_heads=2, add_extra=window)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids[None]).logits[0]
        # transformers' GGUF reader takes Qwen3's and Gemma 3's head_dim and query scale from its own defaults
        # (128, 256), not the file: it checks the tiny files of the other families only (the real Gemma 3 file:
        # tests/models/test_gemma3_real.py)
        if arch in ("llama", "qwen2"):
            from_file = AutoModelForCausalLM.from_pretrained(hf_dir, gguf_file=name, dtype=torch.float32)
            assert (
                from_file.eval()(ids[None]).logits[0] - ref
            ).abs().max().item() < 1e-4  # the file is right
        ours = load_model(hf_dir / name, dtype=torch.float32)
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids))))
    assert (logits - ref).abs().max().item() < 1e-4
