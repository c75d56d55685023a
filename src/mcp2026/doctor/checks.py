"""Every doctor check, in report order, grouped by section (runtime, memory, model, kv, serving)."""

from __future__ import annotations

from mcp2026.doctor import kv_layout, memory, model_checks, runtime, serving, weights
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import Check, CheckResult, run_checks

CHECKS: tuple[Check, ...] = (
    Check("runtime", "python", runtime.check_python),
    Check("runtime", "torch", runtime.check_torch),
    Check("runtime", "cpu isa", runtime.check_cpu_isa),
    Check("runtime", "cuda", runtime.check_cuda),
    Check("runtime", "quant kernels", runtime.check_quant_kernels),
    Check("runtime", "fused kernels", runtime.check_fused_kernels),
    Check("memory", "cgroups", memory.check_cgroups),
    Check("memory", "cpu threads", memory.check_cpu_threads),
    Check("memory", "memory fit", memory.check_memory_fit),
    Check("memory", "read bandwidth", memory.check_bandwidth),
    Check("memory", "huge pages", memory.check_huge_pages),
    Check("model", "files", model_checks.check_model_files),
    Check("model", "architecture", model_checks.check_architecture),
    Check("model", "quant config", model_checks.check_quant_config),
    Check("model", "weight distribution", weights.check_weight_distribution),
    Check("kv", "layout", kv_layout.check_kv_layout),
    Check("serving", "port", serving.check_serve_port),
    Check("serving", "tls", serving.check_tls),
    Check("serving", "tenants", serving.check_tenants),
    Check("serving", "readiness", serving.check_readiness),
)
SECTIONS = tuple(dict.fromkeys(c.section for c in CHECKS))


def run_doctor(ctx: DoctorContext, checks: tuple[Check, ...] = CHECKS) -> list[CheckResult]:
    return run_checks(checks, ctx)
