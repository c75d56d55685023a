"""Our CPU kernels (``kernels/*.cpp``, bound in ``bindings.cpp``): built once per machine, cached, optional.

A decode step of a small model on the CPU is bound by how many ops it dispatches (~2-5 us each), not by
arithmetic; these kernels fold the elementwise chains of a layer and the paged decode attention into one call
each. They are compiled with torch's ``cpp_extension`` for the host CPU (``-march=native``) the first time an
engine needs them (~1 minute on 2 cores), into ``hardware.cache_dir()/kernels/<key>`` where the key covers
every source and header file, the torch version and the CPU's instruction-set flags, so a shared home
directory never hands one CPU a binary built for another. Without a compiler, or with ``MCP2026_KERNELS=0``,
every caller falls back to the plain torch ops (same results within float rounding; tests check both paths
against each other).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mcp2026 import hardware

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
# Every C++ file of the module (tests check that these are all the .cpp and .h files beside this one).
SOURCES = tuple(
    KERNEL_DIR / name
    for name in (
        "bindings.cpp",  # the Python module
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "elementwise.cpp",
        "fused_layer.cpp",
        "gemv.cpp",
        "int4_gemm.cpp",
        "int8_gemm.cpp",
        "block_gemm.cpp",
        "kv_write.cpp",
        "staged_merge.cpp",
        "lookup_guard.cpp",
    )
)
HEADERS = tuple(
    KERNEL_DIR / name
    for name in (
        "cpu_kernels.h", "simd.h", "kv_blocks.h", "attention_bf16.h", "attention_int_codes.h", "decode_ranges.h",
        "quantize_rows.h", "vnni_gemm.h", "thread_team.h",
    )
)  # fmt: skip
_lock = threading.Lock()
_module: Any = None
_reason: str | None = None  # why the kernels are unavailable (None: not tried yet, or loaded)
_tried = False


def enabled_by_env() -> bool:
    return os.environ.get("MCP2026_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


# The instruction-set flags `-march=native` compiles for. Other /proc/cpuinfo flags (mitigations, timer and
# hypervisor bits) can change with a host's microcode or kernel and must not force a rebuild.
_ISA_PREFIXES = (
    "avx", "sse", "ssse", "fma", "f16c", "bmi", "adx", "aes", "pclmul", "popcnt", "lzcnt", "abm", "movbe",
    "sha", "vaes", "vpclmul", "gfni", "amx", "xop", "rdrand", "rdseed", "vnni", "asimd", "sve", "fphp", "i8mm",
    "bf16",
)  # fmt: skip


def isa_flags(flags: frozenset[str]) -> list[str]:
    return sorted(f for f in flags if f.startswith(_ISA_PREFIXES))


CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
LDFLAGS = ("-fopenmp",)


def build_key() -> str:
    """What a built module depends on: the sources, the flags, torch's version and the CPU's instruction sets."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join((*CFLAGS, *LDFLAGS)).encode())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(isa_flags(hardware.cpu_flags())).encode())
    return digest.hexdigest()[:16]


def load(verbose: bool = False) -> Any | None:
    """The compiled kernel module, building it on first use; None when unavailable (see ``unavailable_reason``)."""
    if _tried:
        return _module
    return _load_once(verbose)


def _load_once(verbose: bool) -> Any | None:
    global _module, _reason, _tried
    with _lock:
        if _tried:
            return _module
        if not enabled_by_env():
            _reason = "disabled by MCP2026_KERNELS=0"
        else:
            try:
                _module = _build(verbose)
            except Exception as exc:  # no compiler, no ninja, a failed build: fall back, say why once
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                _reason = f"build failed ({type(exc).__name__}: {first_line})"
                log.warning("mcp2026: fused CPU kernels unavailable, using plain torch ops: %s", _reason)
        _tried = True
        return _module


def unavailable_reason() -> str | None:
    return _reason


# A build takes ~2.5 min on 2 busy cores here; torch waits, without end, while its lock file exists, and a build
# killed midway (a timed-out process) leaves that file behind: every later start would hang. Our own loads hold
# an flock (which dies with its process) while torch's lock exists, so a load that holds the flock knows any
# torch lock is stale; this age limit covers file systems without flock.
STALE_LOCK_S = 30 * 60


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove a build lock older than any build takes (its build was killed); True when one was removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning(
        "mcp2026: removing a stale kernel build lock (%.0f min old: its build was interrupted)", age / 60
    )
    lock.unlink(missing_ok=True)
    return True


def _build(verbose: bool) -> Any:
    key = build_key()
    name = f"mcp2026_cpu_{key}"
    build_dir = hardware.cache_dir() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    with _held_build_lock(build_dir) as exclusive:
        if exclusive:  # no load of ours runs beside this one: a torch lock left here is a killed build's
            (build_dir / "lock").unlink(missing_ok=True)
        else:
            clear_stale_lock(build_dir)
        built = build_dir / f"{name}.so"
        if built.exists():
            module = _import_built(name, built)
            if module is not None:
                return module
        else:
            log.warning("mcp2026: building the fused CPU kernels once for this machine (about a minute)...")
        from torch.utils import cpp_extension  # heavy (setuptools, compilers): only a kernel build needs it

        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in _stage_sources(build_dir)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            verbose=verbose,
        )


def _import_built(name: str, path: Path) -> Any | None:
    """The module built earlier for this key (the key covers everything the build depends on, so an existing
    file is this build's; importing it directly skips torch's build tooling and its ninja check). None when the
    file does not load (a build killed while linking): it is removed, and the caller builds it again."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # an existing file with a module name always has one
    try:
        module = importlib.util.module_from_spec(spec)  # an extension module is opened here
        spec.loader.exec_module(module)
    except ImportError as exc:
        log.warning("mcp2026: the built kernels at %s do not load (%s); building them again", path, exc)
        path.unlink(missing_ok=True)
        return None
    return module


@contextlib.contextmanager
def _held_build_lock(build_dir: Path) -> Iterator[bool]:
    """An exclusive flock on the build folder for this load (waits for another process's load); yields False
    where flock is unavailable. The kernel releases it when its holder dies, unlike torch's lock file."""
    try:
        import fcntl  # POSIX only; elsewhere torch's lock and the age limit are all there is
    except ImportError:
        yield False
        return
    with open(build_dir / ".mcp2026-load.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without flock
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stage_sources(build_dir: Path) -> list[Path]:
    """Copies of the sources and headers inside the build folder, built from there: the build then depends
    only on their contents (which the key hashes), not on where this package is installed, so two checkouts
    of the same sources share one build instead of rebuilding it in turn for their own paths."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for path in (*SOURCES, *HEADERS):
        target = staged / path.name
        data = path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(target)  # atomic: a concurrent build never reads half a file
    return [staged / path.name for path in SOURCES]


def main() -> int:
    """``python -m mcp2026.kernels.cpu``: build (or find) the kernels now, as ``make setup`` does, in one line."""
    start = time.perf_counter()
    module = load()
    if module is None:  # a failed build fails set-up loudly; MCP2026_KERNELS=0 is a choice
        print(f"mcp2026: CPU kernels unavailable: {unavailable_reason()}; the plain torch ops will run")
        return 0 if not enabled_by_env() else 1
    print(
        f"mcp2026: CPU kernels ready ({time.perf_counter() - start:.0f} s) in {Path(module.__file__).parent}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
