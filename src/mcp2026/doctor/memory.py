"""Memory section: weights + KV pool vs the memory available (cgroup limit counted), the thread count vs
usable cores (cgroup CPU quota counted), the cgroup view itself, the measured read bandwidth, and whether the
weights can sit on transparent huge pages."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from mcp2026 import hardware
from mcp2026.config import EngineConfig, ModelConfig
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import CheckResult, failed, passed, skipped, warned
from mcp2026.engine import weight_pages
from mcp2026.kv.sizing import kv_block_bytes, plan_kv_blocks
from mcp2026.loading.loader import MAX_ROPE_POSITIONS

WARN_FRACTION = 0.9  # weights + KV above this share of available memory leave no room for activations
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def kv_pool_bytes(
    engine: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, free_after_weights: int
) -> tuple[int, int]:
    """(blocks, bytes) of the KV pool the engine would allocate once the weights are loaded: the fraction
    rule takes its share of the memory still available then. ValueError when it holds no full sequence."""

    max_len = min(engine.scheduler.max_model_len or cfg.max_position_embeddings, MAX_ROPE_POSITIONS)
    codec = engine.kv_compressor.make_codec() if engine.kv_compressor is not None else None
    kv = engine.resolved_kv
    if kv.num_blocks is None and kv.memory_gb is None:
        kv = dataclasses.replace(kv, memory_gb=kv.memory_fraction * free_after_weights / 1e9)
    blocks = plan_kv_blocks(kv, cfg, dtype, max_len, engine.scheduler.max_num_seqs, codec=codec)
    return blocks, blocks * kv_block_bytes(cfg, kv.block_size, dtype, codec)


def check_memory_fit(ctx: DoctorContext) -> CheckResult:
    name = "memory fit"
    if (skip := ctx.needs_model(name)) is not None:
        return skip
    cfg, files, dtype = ctx.model_config(), ctx.model_files(), ctx.activation_dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Quantization happens after a full-precision load, so the load's footprint is what must fit.
    weights = files.file_bytes if files.file_format == "mcp2026-artifact" else cfg.num_params * itemsize
    available, limit = hardware.available_memory_bytes(), hardware.cgroup_memory_limit_bytes()
    details = {
        "weights_bytes": weights,
        "available_bytes": available,
        "cgroup_limit_bytes": limit,
        "dtype": str(dtype).removeprefix("torch."),
    }
    where = f"available {_gib(available)} (cgroup limit {_gib(limit) if limit else 'none'})"
    fix = (
        "free memory or raise the container's memory limit; or lower kv.memory_gb / kv.memory_fraction / "
        "scheduler.max_model_len in the serve YAML, or quantize the weights"
    )
    if weights >= available:
        return failed(name, f"weights alone need {_gib(weights)}, {where}", fix, **details)
    try:
        blocks, pool = kv_pool_bytes(ctx.engine, cfg, dtype, available - weights)
    except ValueError as e:
        return failed(name, f"KV pool: {e}; {where}", fix, **details)
    total = weights + pool
    details.update(kv_blocks=blocks, kv_pool_bytes=pool, total_bytes=total, share=total / available)
    reason = (
        f"weights {_gib(weights)} ({details['dtype']}) + KV pool {_gib(pool)} ({blocks} blocks of "
        f"{ctx.engine.block_size}) = {_gib(total)} at full use, {total / available:.0%} of {where}"
    )
    if total > available:
        return failed(name, reason, fix, **details)
    if total > WARN_FRACTION * available:
        return warned(name, reason, "leave headroom for activations: " + fix, **details)
    return passed(name, reason, **details)


def check_cpu_threads(ctx: DoctorContext) -> CheckResult:
    name = "cpu threads"
    usable, threads = hardware.usable_cpu_count(), torch.get_num_threads()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = hardware.cgroup_cpu_quota()
    details = {"usable": usable, "torch_threads": threads, "affinity": affinity, "cgroup_cpu_quota": quota}
    limits = f"affinity {affinity} cores, cgroup quota {f'{quota:g} CPUs' if quota else 'none'}"
    if threads < usable:
        source = (
            f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}" if "OMP_NUM_THREADS" in os.environ else "torch"
        )
        return warned(
            name,
            f"torch runs {threads} threads ({source}) but {usable} cores are usable ({limits})",
            f"unset OMP_NUM_THREADS or set it to {usable}",
            **details,
        )
    capped = f", capped from torch's {threads}" if threads > usable else ""
    return passed(name, f"the engine runs {usable} threads{capped} ({limits})", **details)


def _own_cgroup_path(proc_cgroup: str, controller: str | None) -> str | None:
    """This process's cgroup path for ``controller`` (v1) or the unified hierarchy (None)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (controller is None and parts[0] == "0" and parts[1] == "") or (
            controller is not None and controller in parts[1].split(",")
        ):
            return parts[2]
    return None


def own_cgroup_memory_limit(root: Path, proc_cgroup: str) -> int | None:
    """The memory limit of the cgroup this process is in (not the mount root), if it has one."""
    v2 = (root / "cgroup.controllers").exists()
    rel = _own_cgroup_path(proc_cgroup, None if v2 else "memory")
    if rel is None or rel == "/":
        return None
    folder = (root if v2 else root / "memory") / rel.lstrip("/")
    for file in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (folder / file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" / a huge v1 number: no limit
            return int(text)
    return None


def check_cgroups(
    ctx: DoctorContext, root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> CheckResult:
    name = "cgroups"
    if not sys.platform.startswith("linux"):
        return skipped(name, f"no cgroups on {sys.platform}")
    if (root / "cgroup.controllers").exists():
        version, controllers = "v2", (root / "cgroup.controllers").read_text().split()
    elif (root / "memory").is_dir() or (root / "cpu").is_dir():
        version, controllers = "v1", [c for c in ("memory", "cpu", "cpuset") if (root / c).is_dir()]
    else:
        return warned(
            name,
            f"no cgroup filesystem at {root}: a container's memory and CPU limits are invisible to the engine",
            "mount cgroupfs, or set kv.memory_gb in the serve YAML and OMP_NUM_THREADS explicitly",
        )
    memory, quota = hardware.cgroup_memory_limit_bytes(), hardware.cgroup_cpu_quota()
    details = {
        "version": version,
        "controllers": controllers,
        "memory_limit_bytes": memory,
        "cpu_quota": quota,
    }
    try:
        own = own_cgroup_memory_limit(root, proc_cgroup.read_text())
    except OSError:
        own = None
    if own is not None and (memory is None or own < memory):
        return warned(
            name,
            f"this process's cgroup limits memory to {_gib(own)} but the engine reads "
            f"{_gib(memory) if memory else 'no limit'} at {root}: the KV pool may be sized too large",
            "run in a container whose own cgroup is mounted at /sys/fs/cgroup (cgroup namespace), "
            "or set kv.memory_gb in the serve YAML",
            own_memory_limit_bytes=own,
            **details,
        )
    return passed(
        name,
        f"cgroup {version} ({', '.join(controllers)}): memory limit {_gib(memory) if memory else 'none'}, "
        f"CPU quota {f'{quota:g} CPUs' if quota else 'none'}; KV sizing and the thread count use them",
        **details,
    )


def check_bandwidth(ctx: DoctorContext) -> CheckResult:
    name = "read bandwidth"
    if ctx.quick:
        return skipped(name, "a measurement (--quick); cached after the first full run")
    bandwidth = hardware.peak_read_bandwidth()
    return passed(
        name,
        f"peak memory read {bandwidth / 1e9:.1f} GB/s (a large in-memory reduction; cached per machine)",
        bytes_per_s=bandwidth,
    )


def check_huge_pages(ctx: DoctorContext) -> CheckResult:
    name = "huge pages"
    mode = weight_pages.huge_page_mode()
    setting = f"mode {mode}" if mode else "no transparent_hugepage setting"
    if weight_pages.huge_pages_available():
        return passed(
            name,
            f"transparent huge pages: {setting}; CPU weights are placed in one huge-page mapping, so decode, "
            "which streams them every step, misses the TLB once per 2 MiB instead of once per 4 KiB",
            setting=setting,
        )
    return warned(
        name,
        f"transparent huge pages are unavailable ({setting}): CPU weights stay on 4 KiB pages and every decode "
        "step pays a TLB miss per 4 KiB of weights it streams",
        "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled (or boot with "
        "transparent_hugepage=madvise)",
        setting=setting,
    )
