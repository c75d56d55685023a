"""The engine runs torch on at most the cores the process may use (cgroup quota, affinity)."""

from __future__ import annotations

import torch

from mcp2026 import hardware
from mcp2026.config import EngineConfig, KVConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.hardware import cap_cpu_threads
from mcp2026.loading.loader import load_model


def test_engine_caps_torch_threads_to_usable_cores(monkeypatch, tiny_llama_dir):
    loaded = load_model(tiny_llama_dir)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(hardware, "usable_cpu_count", lambda: 1)
        LLMEngine(loaded.model, loaded.config, None, EngineConfig(KVConfig(num_blocks=64)))
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(hardware, "usable_cpu_count", lambda: 8)
        assert cap_cpu_threads() == 1  # never raises a lower count (OMP_NUM_THREADS, set_num_threads)
    finally:
        torch.set_num_threads(before)
