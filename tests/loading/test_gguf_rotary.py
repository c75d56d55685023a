"""GGUF q/k rows in llama.cpp's layout per family: the Llama converter permutes them for its interleaved
rotary, the Qwen2 one does not (llama.cpp runs Qwen2 with NeoX rotary). Each file is written the way
llama.cpp's converter writes it; transformers reading the same file is the check that the layout is right."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model

from conftest import save_tiny_hf
from gguf_files import write_converted_gguf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_rotary_layout_matches_hf(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    hf_dir = save_tiny_hf(tmp_path, arch=arch)
    name = write_converted_gguf(hf_dir, arch, heads=4, kv_heads=2)
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids[None]).logits[0]
        from_file = AutoModelForCausalLM.from_pretrained(hf_dir, gguf_file=name, dtype=torch.float32)
        assert (from_file.eval()(ids[None]).logits[0] - ref).abs().max().item() < 1e-4  # the file is right
        ours = load_model(hf_dir / name, dtype=torch.float32)
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids))))
    assert (logits - ref).abs().max().item() < 1e-4
