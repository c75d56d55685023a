"""Runtime section: Python and torch versions, CPU instruction sets, CUDA devices, and which quantized
weight formats have a real kernel here and how fast they run (quant/backend.py's cached probe)."""

from __future__ import annotations

import platform
import sys
import warnings

import torch

from mcp2026 import hardware
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import CheckResult, Status, failed, passed, skipped, warned
from mcp2026.hardware import default_activation_dtype
from mcp2026.kernels import cpu, gpu
from mcp2026.quant.backend import clamp_bits, probe
from mcp2026.quant.linear import LINEAR_FORMATS
from mcp2026.quant.plan import FORMATS, WEIGHT_BITS

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 5)  # pyproject's lower bound
X86_ISA = {  # what the kernels care about -> any of these /proc/cpuinfo flags
    "AVX2": ("avx2",),
    "AVX-512": ("avx512f",),
    "VNNI": ("avx512_vnni", "avx_vnni"),
    "BF16": ("avx512_bf16",),
    "AMX": ("amx_tile", "amx_bf16"),
}
ARM_ISA = {"NEON": ("asimd",), "SVE": ("sve",), "BF16": ("bf16",), "I8MM": ("i8mm",)}


def check_python(ctx: DoctorContext) -> CheckResult:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return failed("python", f"Python {version} is older than 3.10", "use Python 3.10 or newer")
    return passed("python", f"Python {version} ({sys.executable})", version=version)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


def check_torch(ctx: DoctorContext) -> CheckResult:
    version = torch.__version__
    capability = torch.backends.cpu.get_cpu_capability()
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    details = {"version": version, "cpu_capability": capability, "cuda_build": torch.version.cuda}
    if _version_tuple(version) < MIN_TORCH:
        return failed(
            "torch",
            f"torch {version} is older than 2.5",
            "install torch 2.5 or newer (make setup)",
            **details,
        )
    return passed("torch", f"torch {version} ({build}), CPU kernels: {capability}", **details)


def check_cpu_isa(ctx: DoctorContext) -> CheckResult:
    flags = hardware.cpu_flags()
    machine = platform.machine().lower()
    groups = ARM_ISA if machine in ("aarch64", "arm64") else X86_ISA
    present = [g for g, names in groups.items() if any(n in flags for n in names)]
    absent = [g for g in groups if g not in present]

    act = str(default_activation_dtype("cpu")).removeprefix("torch.")
    details = {"cpu": hardware.cpu_model(), "present": present, "absent": absent, "activation_dtype": act}
    reason = (
        f"{hardware.cpu_model()}: {', '.join(present) or 'none of ' + '/'.join(groups)}"
        + (f"; no {', '.join(absent)}" if absent else "")
        + f"; activations run in {act}"
    )
    if groups is X86_ISA and "AVX2" not in present:
        return warned(
            "cpu isa", reason, "expect slow matmuls: run on a CPU with AVX2 (any x86 since 2013)", **details
        )
    return passed("cpu isa", reason, **details)


def check_cuda(ctx: DoctorContext) -> CheckResult:
    if not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return skipped("cuda", f"no CUDA device (torch is {build})")
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, _ = torch.cuda.mem_get_info(i)
        devices.append(
            {
                "name": props.name,
                "capability": f"sm{props.major}{props.minor}",
                "memory_bytes": props.total_memory,
                "free_bytes": free,
            }
        )
    listing = "; ".join(
        f"{d['name']} {d['capability']}, {d['free_bytes'] / 2**30:.0f} of {d['memory_bytes'] / 2**30:.0f} GiB free"
        for d in devices
    )
    if ctx.device.type == "cuda" and ctx.device.index is None and not devices:
        return failed(
            "cuda", "the server is set to run on CUDA but no device is visible", "check CUDA_VISIBLE_DEVICES"
        )
    return passed(
        "cuda", f"{len(devices)} device(s): {listing}; the server runs on {ctx.device}", devices=devices
    )


def _judge_request(name: str, reason: str, usable: list[str], ctx: DoctorContext, **details) -> CheckResult:
    quant = ctx.uniform_quant()
    if quant is None or quant.target_precision in usable:
        return passed(name, reason, **details)
    fmt, strict = quant.target_precision, quant.strict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nearest = clamp_bits(WEIGHT_BITS[fmt], usable)
    why = f"the quant YAML asks for {fmt}, which is not usable here; {reason}"
    if strict:
        return failed(name, why, f"pick one of {', '.join(usable)}, or set strict: false", **details)
    return warned(name, why + f"; it is clamped to {nearest}", f"pick one of {', '.join(usable)}", **details)


def check_quant_kernels(ctx: DoctorContext) -> CheckResult:
    name = "quant kernels"
    kernels = {fmt: LINEAR_FORMATS[fmt].kernel_on(ctx.device) for fmt in FORMATS}
    missing = [f for f, k in kernels.items() if k is None]
    none = f"; no real kernel: {', '.join(missing)}" if missing else ""
    if ctx.quick:
        have = [f for f, k in kernels.items() if k is not None]
        reason = f"real kernels on {ctx.device}: {', '.join(have)}{none}; speed not measured (--quick)"
        return _judge_request(name, reason, have, ctx, kernels=kernels)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = probe(ctx.device)
    speeds = ", ".join(
        f"{r.format} x{r.speedup.get('1', 0):.2f}/x{r.speedup.get('32', 0):.2f}"
        for r in report.formats.values()
        if r.has_kernel and r.format != report.baseline_format
    )
    candidates = list(report.candidates())
    reason = f"candidates: {', '.join(candidates)}; speed vs {report.baseline_format} at batch 1/32: {speeds}{none}"
    details = {
        "baseline": report.baseline_format,
        "formats": {
            f: {
                "kernel": r.kernel,
                "compute_dtype": r.compute_dtype,
                "speedup": r.speedup,
                "is_candidate": r.is_candidate,
                "reason": r.reason,
            }
            for f, r in report.formats.items()
        },
        "notes": [str(w.message) for w in caught],
    }
    result = _judge_request(name, reason, candidates, ctx, **details)
    if caught and result.status is Status.PASS:  # e.g. "CPU busy: backend timings not cached"
        return warned(
            name,
            f"{reason}; {'; '.join(details['notes'])}: these figures are unreliable",
            "run `mcp2026 doctor` again on an idle machine: figures measured there are cached",
            **details,
        )
    return result


def check_fused_kernels(ctx: DoctorContext) -> CheckResult:
    """Our C++ decode kernels (kernels/*.cpp): built and cached, or why the engine falls back."""
    name = "fused kernels"
    if ctx.device.type == "cuda":  # the Triton kernels: decode attention over paged blocks, fused layer ops
        status = gpu.status()
        if gpu.load() is None:
            return warned(
                name,
                f"GPU kernels {status}; decode gathers the KV blocks and runs eagerly, without CUDA graphs",
                "pip install triton",
            )
        return passed(name, f"GPU kernels: {status} (paged decode attention, fused norms/RoPE, CUDA graphs)")
    if ctx.device.type != "cpu":
        return skipped(name, f"CPU kernels; the server runs on {ctx.device}")
    if not cpu.enabled_by_env():
        return warned(
            name, "disabled by MCP2026_KERNELS=0", "unset MCP2026_KERNELS for ~2x faster CPU decode"
        )
    cached = (hardware.cache_dir() / "kernels" / cpu.build_key()).exists()
    if ctx.quick and not cached:
        return skipped(name, "not built yet (--quick); the first engine start builds them (about a minute)")
    if cpu.load() is None:
        return warned(
            name,
            f"unavailable: {cpu.unavailable_reason()}; decode runs on plain torch ops",
            "install a C++ compiler (g++) and ninja, then rerun",
        )
    return passed(
        name, "built for this CPU (paged decode attention, fused norms, int4 GEMV)", key=cpu.build_key()
    )
