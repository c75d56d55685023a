"""Backend capability registry: cached micro-benchmark, candidate rule, clampBitwidth, activation dtype."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from rich.console import Console

from mcp2026 import hardware
from mcp2026.quant import backend
from mcp2026.quant.backend import BackendReport, BenchSettings, clamp_bits, default_activation_dtype

TINY = BenchSettings(
    in_features=64, out_features=64, batches=(1, 4), rounds=2, target_s=0.0002, cache_when_busy=True
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MCP2026_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_probe_writes_cache_and_reads_it_back(cache_dir, monkeypatch):
    report = backend.probe("cpu", settings=TINY)
    path = cache_dir / "backend.json"
    assert path.exists() and report.key in json.loads(path.read_text())

    def must_not_measure(*args, **kwargs):
        raise AssertionError("cached report ignored")

    monkeypatch.setattr(backend, "measure", must_not_measure)
    again = backend.probe("cpu", settings=TINY)
    assert again == report
    with pytest.raises(AssertionError, match="cached report ignored"):
        backend.probe("cpu", refresh=True, settings=TINY)


def test_report_on_cpu(cache_dir):
    report = backend.probe("cpu", settings=TINY)
    assert BackendReport.from_json(report.to_json()) == report
    fp8 = report.formats["fp8"]
    assert not fp8.has_kernel and not fp8.is_candidate and fp8.kernel is None  # no fp8 arithmetic on CPU
    assert report.formats["fp32"].is_candidate and "fp32" in report.candidates()
    int4 = report.formats["int4"]
    assert int4.has_kernel and int4.kernel == "aten._weight_int4pack_mm_for_cpu"
    assert int4.bits_per_weight == {"g32": 5.0, "g64": 4.5, "g128": 4.25}
    assert set(int4.timings_us) == {"fp32", "bf16", "fp16"}  # every activation dtype the kernel takes
    for fmt in report.candidates():
        limits = {
            b: backend.SLOWDOWN_LIMITS.get(int(b), backend.DEFAULT_SLOWDOWN_LIMIT) for b in report.baseline_us
        }
        ok = fmt in ("fp32", report.baseline_format)
        assert ok or all(1 / s <= limits[b] for b, s in report.formats[fmt].speedup.items())
    assert report.compute_dtypes["int4"] in (torch.float32, torch.bfloat16, torch.float16)
    Console(width=200, record=True).print(report.to_table())


def test_key_depends_on_threads_and_settings():
    device = torch.device("cpu")
    key = backend.machine_key(device, TINY)
    assert key != backend.machine_key(device, BenchSettings())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3 - threads if threads in (1, 2) else 1)
        assert backend.machine_key(device, TINY) != key
    finally:
        torch.set_num_threads(threads)


def test_clamp_bits_nearest_with_warning():
    candidates = ("int4", "int8", "fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert clamp_bits(8, candidates) == "int8"  # exact: no warning
    with pytest.warns(UserWarning, match=r"5 bits .* nearest is int4"):
        assert clamp_bits(5, candidates) == "int4"
    with pytest.warns(UserWarning, match="nearest is int8"):
        assert clamp_bits(6, candidates) == "int8"  # tie goes to the wider format
    with pytest.warns(UserWarning, match="nearest is int8"):
        assert clamp_bits(16, candidates) == "int8"  # nearest by width: 8 is closer to 16 than 32
    with pytest.warns(UserWarning, match="nearest is bf16"):
        assert clamp_bits(12, ("int8", "bf16", "fp16", "fp32")) == "bf16"  # equal widths: first listed


def test_clamp_bits_strict_lists_candidates():
    with pytest.raises(ValueError, match=r"Candidates: int4 \(4 bits\), fp32 \(32 bits\)"):
        clamp_bits(8, ("int4", "fp32"), strict=True)
    with pytest.raises(ValueError, match="unknown formats"):
        clamp_bits(8, ("int3",))


def test_default_activation_dtype(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert default_activation_dtype("cpu") == torch.float32
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert default_activation_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert default_activation_dtype("cpu") == torch.float32


def test_busy_machine_report_is_not_cached(cache_dir, monkeypatch):
    monkeypatch.setattr(backend, "_load_avg", lambda: 5.0)
    settings = BenchSettings(in_features=64, out_features=64, batches=(1,), rounds=1, target_s=0.0001)
    with pytest.warns(UserWarning, match="not cached"):
        report = backend.probe("cpu", settings=settings)
    assert report.load_avg == 5.0 and not (cache_dir / "backend.json").exists()
