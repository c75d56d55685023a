"""What this machine offers: CPU features, usable memory and cores (cgroup limits counted), and the
measured peak memory read bandwidth (cached on disk). Environment variables are read here only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import platform
import resource
import time
from functools import lru_cache
from pathlib import Path

import torch


def cache_dir() -> Path:
    """Where measured machine facts are cached (``MCP2026_CACHE_DIR`` overrides ~/.cache/mcp2026)."""
    root = os.environ.get("MCP2026_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mcp2026")
    return Path(root)


def cpuinfo_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's "key: value" lines of /proc/cpuinfo (empty where there is no such file)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block ends
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    fields = cpuinfo_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_model() -> str:
    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def cpu_family_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """'family F, model M': what tells CPU generations apart where the model name does not (a cloud "AMD EPYC"
    is a Zen 3, 4 or 5); None where /proc/cpuinfo says nothing."""
    fields = cpuinfo_fields(cpuinfo)
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']}, model {fields['model']}"


def has_fast_bf16() -> bool:
    """bf16 matmuls are only fast with AVX512-BF16 or AMX on CPU (elsewhere several times slower than fp32)."""
    if torch.cuda.is_available():
        return True
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_activation_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 on CUDA (where supported) and on CPUs with AVX512-BF16 or AMX that torch dispatches AVX-512
    kernels on; fp32 everywhere else (on AVX2-only CPUs bf16 matmuls are several times slower)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type != "cpu":
        return torch.float32
    flags = cpu_flags()
    has_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    return (
        torch.bfloat16
        if has_bf16 and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        else torch.float32
    )


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text)


def cgroup_memory_limit_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        value = _read_int(path)
        if value is not None and value < 1 << 60:
            return value
    return None


def total_memory_bytes() -> int:
    """Physical memory, capped by the cgroup limit."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit_bytes()
    return min(total, limit) if limit is not None else total


def available_memory_bytes() -> int:
    """Memory we may still use: MemAvailable, capped by the cgroup limit minus its current usage."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    limit = cgroup_memory_limit_bytes()
    if limit is not None:
        used = (
            _read_int("/sys/fs/cgroup/memory.current")
            or _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
            or 0
        )
        available = min(available, max(limit - used, 0))
    return available


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup quota allows (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``); None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    quota = _read_int(str(root / "cpu" / "cpu.cfs_quota_us"))  # -1: no quota
    period = _read_int(str(root / "cpu" / "cpu.cfs_period_us"))
    return quota / period if quota is not None and period and quota > 0 else None


def usable_cpu_count() -> int:
    """Cores we may use: affinity mask, capped by a cgroup CPU quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return count if quota is None else min(count, max(1, int(quota)))


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library, found once (``find_library`` runs ``ldconfig -p`` in a subprocess each time)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``); False where there is no glibc.

    Loading a model frees hundreds of MB of temporaries that glibc keeps mapped, so without this a server's
    resident memory stays at the load's peak for its whole life."""
    libc = _libc()
    try:
        return bool(libc.malloc_trim(0)) if libc is not None else False
    except AttributeError:  # musl and other libcs have no malloc_trim
        return False


# glibc's mallopt parameter for the size from which an allocation gets its own mapping
_M_MMAP_THRESHOLD = -3


def return_large_blocks_at_once(threshold_bytes: int = 1 << 20) -> bool:
    """From now on, allocations of ``threshold_bytes`` or more get their own mapping, handed back to the OS as soon
    as they are freed (glibc ``mallopt(M_MMAP_THRESHOLD)``); False where there is no glibc.

    Why: glibc raises that threshold to the largest block freed so far (up to 32 MB), after which a prefill step's
    MB-sized temporaries come from the heap and stay resident until the next trim. A serving process pays a page
    fault per 4 KiB of such a temporary instead (small beside the matmuls that fill it). A process-wide setting:
    ``mcp2026 serve`` sets it for its own process; a library call never does."""
    libc = _libc()
    try:
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) if libc is not None else False
    except AttributeError:
        return False


def peak_rss_reset() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) so a later read is the peak of what followed."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure_read_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def peak_read_bandwidth(refresh: bool = False) -> float:
    """Bytes/s the CPU can stream from memory (a large reduction, best of 5), cached per machine."""
    key = f"{cpu_model()}|{usable_cpu_count()}|{torch.get_num_threads()}"
    path = cache_dir() / "bandwidth.json"
    cached: dict[str, float] = {}
    if path.exists():
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}
    if key in cached and not refresh:
        return float(cached[key])
    value = _measure_read_bandwidth()
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass
    return value


def cap_cpu_threads() -> int:
    """Run torch on at most the cores this process may use: torch starts one thread per core it sees,
    but a container's CPU quota (cgroup) may grant fewer, and oversubscribed threads stall each other.
    Never raises a lower count (OMP_NUM_THREADS, torch.set_num_threads). Returns the thread count."""
    usable = usable_cpu_count()
    if torch.get_num_threads() > usable:
        torch.set_num_threads(usable)
    return torch.get_num_threads()
