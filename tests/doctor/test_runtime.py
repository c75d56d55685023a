"""Runtime checks: versions and ISA pass here; a CPU without AVX2 warns; the quant kernel check judges
the format a quant YAML asks for (strict: FAIL, else WARN with the format it is clamped to)."""

from __future__ import annotations

import platform

import pytest

from mcp2026 import hardware
from mcp2026.doctor import runtime
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import Status
from mcp2026.quant.linear import LINEAR_FORMATS
from mcp2026.serve.config import ServeConfig


def test_versions_pass_here():
    assert runtime.check_python(DoctorContext()).status is Status.PASS
    result = runtime.check_torch(DoctorContext())
    assert result.status is Status.PASS and result.details["cpu_capability"]


def test_cpu_isa_lists_present_and_absent_groups(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    result = runtime.check_cpu_isa(DoctorContext())
    assert result.status is Status.PASS
    assert result.details["present"] == ["AVX2", "AVX-512"]
    assert result.details["absent"] == ["VNNI", "BF16", "AMX"]
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert runtime.check_cpu_isa(DoctorContext()).status is Status.WARN


def _ctx_with_quant(tmp_path, text: str) -> DoctorContext:
    path = tmp_path / "quant.yaml"
    path.write_text(text)
    return DoctorContext(serve=ServeConfig(quant=str(path)), quick=True)


def test_quick_quant_kernels_list_formats_without_measuring():
    result = runtime.check_quant_kernels(DoctorContext(quick=True))
    assert result.status is Status.PASS and "not measured" in result.reason
    assert result.details["kernels"]["int8"] == LINEAR_FORMATS["int8"].kernel_on(DoctorContext().device)


@pytest.mark.skipif(
    LINEAR_FORMATS["fp8"].kernel_on(DoctorContext().device) is not None, reason="fp8 has a kernel"
)
def test_a_requested_format_without_kernel_fails_when_strict_and_warns_otherwise(tmp_path):
    result = runtime.check_quant_kernels(_ctx_with_quant(tmp_path, "target_precision: fp8\nstrict: true\n"))
    assert result.status is Status.FAIL and "fp8" in result.reason and "strict: false" in result.fix
    result = runtime.check_quant_kernels(_ctx_with_quant(tmp_path, "target_precision: fp8\n"))
    assert result.status is Status.WARN and "clamped to int8" in result.reason


def test_a_requested_format_with_kernel_passes(tmp_path):
    result = runtime.check_quant_kernels(_ctx_with_quant(tmp_path, "target_precision: int8\n"))
    assert result.status is Status.PASS


def test_cuda_absent_is_skipped(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.check_cuda(DoctorContext()).status is Status.SKIP


def test_fused_kernels_pass_when_built_and_warn_with_the_reason_otherwise(monkeypatch):
    from mcp2026.kernels import cpu

    if cpu.load() is None:
        pytest.skip(f"kernels unavailable here: {cpu.unavailable_reason()}")
    assert runtime.check_fused_kernels(DoctorContext()).status is Status.PASS
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_reason", "build failed (OSError: no compiler)")
    result = runtime.check_fused_kernels(DoctorContext())
    assert result.status is Status.WARN and "no compiler" in result.reason and result.fix
    monkeypatch.setenv("MCP2026_KERNELS", "0")
    assert "MCP2026_KERNELS=0" in runtime.check_fused_kernels(DoctorContext()).reason
