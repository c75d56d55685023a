"""Memory checks: weights + KV pool against available memory (PASS / WARN / FAIL), the thread count
against usable cores, and the cgroup view (a limit on this process's own cgroup that the engine misses)."""

from __future__ import annotations

import pytest
import torch

from mcp2026 import hardware
from mcp2026.config import EngineConfig, KVConfig
from mcp2026.doctor import memory
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import Status
from mcp2026.kv.sizing import kv_block_bytes

GIB = 2**30


def _fit(monkeypatch, ctx: DoctorContext, available: int):
    monkeypatch.setattr(hardware, "available_memory_bytes", lambda: available)
    return memory.check_memory_fit(ctx)


def test_memory_fit_pass_warn_fail(monkeypatch, tiny_llama_dir):
    ctx = DoctorContext(model=tiny_llama_dir, engine=EngineConfig(KVConfig(num_blocks=100)))
    cfg = ctx.model_config()
    dtype = ctx.activation_dtype  # the serve config's "auto": fp32 on AVX2-only CPUs, bf16 where fast
    total = cfg.num_params * dtype.itemsize + 100 * kv_block_bytes(cfg, 16, dtype)
    ok = _fit(monkeypatch, ctx, 4 * total)
    assert ok.status is Status.PASS, ok.reason
    assert ok.details["total_bytes"] == total and ok.details["kv_blocks"] == 100
    assert _fit(monkeypatch, ctx, int(total / 0.95)).status is Status.WARN
    over = _fit(monkeypatch, ctx, total - 1)
    assert over.status is Status.FAIL and "kv.memory_gb" in over.fix
    assert "weights alone" in _fit(monkeypatch, ctx, 1000).reason


def test_fraction_rule_takes_its_share_after_the_weights(monkeypatch, tiny_llama_dir):
    ctx = DoctorContext(model=tiny_llama_dir, engine=EngineConfig(KVConfig(memory_fraction=0.5)))
    cfg = ctx.model_config()
    result = _fit(monkeypatch, ctx, 200 << 20)
    block = kv_block_bytes(cfg, 16, ctx.activation_dtype)
    free = (200 << 20) - result.details["weights_bytes"]
    # the engine's cap: as many full sequences as the scheduler runs at once
    max_blocks = ctx.engine.scheduler.max_num_seqs * (cfg.max_position_embeddings // 16)
    assert result.details["kv_blocks"] == min(int(0.5 * free // block), max_blocks)


def test_kv_budget_below_one_sequence_fails(monkeypatch, tiny_llama_dir):
    ctx = DoctorContext(model=tiny_llama_dir, engine=EngineConfig(KVConfig(memory_gb=1e-6)))
    result = _fit(monkeypatch, ctx, 8 * GIB)
    assert result.status is Status.FAIL and "fewer than one" in result.reason


def test_memory_fit_skips_without_a_model(tmp_path):
    assert memory.check_memory_fit(DoctorContext(model=tmp_path / "none")).status is Status.SKIP


def test_cpu_threads(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(hardware, "usable_cpu_count", lambda: threads + 3)
    result = memory.check_cpu_threads(DoctorContext())
    assert result.status is Status.WARN and f"{threads + 3} cores are usable" in result.reason
    monkeypatch.setattr(hardware, "usable_cpu_count", lambda: 1)
    result = memory.check_cpu_threads(DoctorContext())
    assert result.status is Status.PASS and result.details["usable"] == 1
    assert ("capped" in result.reason) == (threads > 1)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_limit_on_our_own_cgroup_that_the_engine_misses_warns(monkeypatch, tmp_path, version):
    root = tmp_path / "cgroup"
    if version == "v2":
        (root / "job" / "7").mkdir(parents=True)
        (root / "cgroup.controllers").write_text("cpu memory\n")
        (root / "job" / "7" / "memory.max").write_text(f"{GIB}\n")
        proc = "0::/job/7\n"
    else:
        (root / "memory" / "job").mkdir(parents=True)
        (root / "cpu").mkdir()
        (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{GIB}\n")
        proc = "5:cpu,cpuacct:/\n4:memory:/job\n"
    (tmp_path / "self_cgroup").write_text(proc)
    monkeypatch.setattr(hardware, "cgroup_memory_limit_bytes", lambda: None)
    ctx = DoctorContext()
    result = memory.check_cgroups(ctx, root, tmp_path / "self_cgroup")
    assert result.status is Status.WARN and result.details["own_memory_limit_bytes"] == GIB
    monkeypatch.setattr(hardware, "cgroup_memory_limit_bytes", lambda: GIB)  # the engine sees it
    result = memory.check_cgroups(ctx, root, tmp_path / "self_cgroup")
    assert result.status is Status.PASS and result.details["version"] == version


def test_no_cgroup_filesystem_warns(tmp_path):
    result = memory.check_cgroups(DoctorContext(), tmp_path / "absent", tmp_path / "absent_proc")
    assert result.status is Status.WARN and "invisible" in result.reason


def test_bandwidth_is_skipped_in_quick_mode():
    assert memory.check_bandwidth(DoctorContext(quick=True)).status is Status.SKIP


@pytest.mark.parametrize(
    ("setting", "mode", "status"),
    [
        ("always [madvise] never", "madvise", "PASS"),
        ("[always] madvise never", "always", "PASS"),
        ("always madvise [never]", "never", "WARN"),
    ],
)
def test_huge_pages_check_reads_the_transparent_hugepage_setting(
    tmp_path, monkeypatch, setting, mode, status
):
    from mcp2026.engine import weight_pages

    path = tmp_path / "enabled"
    path.write_text(setting + "\n")
    monkeypatch.setattr(weight_pages, "_THP_SETTING", path)
    monkeypatch.setattr(weight_pages.mmap, "MADV_HUGEPAGE", 14, raising=False)
    result = memory.check_huge_pages(DoctorContext())
    assert result.status is Status[status] and f"mode {mode}" in result.reason
    if status == "WARN":
        assert "transparent_hugepage" in result.fix
