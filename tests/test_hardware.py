"""Machine probes and process settings: the cgroup CPU quota (v2 cpu.max, v1 cfs quota/period) caps
usable_cpu_count(); freed large blocks go back to the OS once a serving process asks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mcp2026 import hardware


def test_cgroup_cpu_quota_v2_and_v1(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert hardware.cgroup_cpu_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert hardware.cgroup_cpu_quota(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    assert hardware.cgroup_cpu_quota(v1) == 2.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert hardware.cgroup_cpu_quota(v1) is None
    assert hardware.cgroup_cpu_quota(tmp_path / "absent") is None


def test_usable_cpu_count_is_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: 0.5)
    assert hardware.usable_cpu_count() == 1  # a fractional quota still runs one thread
    monkeypatch.setattr(hardware, "cgroup_cpu_quota", lambda: None)
    assert hardware.usable_cpu_count() >= 1


def test_cpu_family_model_tells_generations_apart(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n")
    assert hardware.cpu_family_model(info) == "family 26, model 2"
    info.write_text("processor\t: 0\nmodel name\t: some CPU\n")
    assert hardware.cpu_family_model(info) is None
    assert hardware.cpu_family_model(tmp_path / "missing") is None


_HEAP_HOLES = """
import sys, torch
from mcp2026 import hardware
if sys.argv[1] == "set":
    assert hardware.return_large_blocks_at_once()
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) << 10
kept, base = [], anon()
for _ in range(8):
    big = torch.ones(2 << 20)  # 8 MB, then a small block above it in the heap: the big one's pages cannot be trimmed
    kept.append(torch.ones(64))
    del big
print(anon() - base)
"""


@pytest.mark.skipif(hardware._libc() is None or not sys.platform.startswith("linux"), reason="glibc only")
def test_large_blocks_go_back_to_the_os_when_freed():
    def growth(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _HEAP_HOLES, mode], capture_output=True, text=True, check=True
        )
        return int(run.stdout.split()[-1])

    assert growth("default") >= 6 << 20  # glibc's raised threshold: a freed 8 MB block stays in the heap
    assert growth("set") < 2 << 20
