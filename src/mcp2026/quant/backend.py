"""Which weight formats this device runs with a real kernel, and how fast: the DQG's candidate set.

``probe()`` times each format's actual module (linear.py) on a representative shape, in every compute
dtype its kernel accepts, against dense ``F.linear`` in the engine's activation dtype, and caches the
report on disk per machine. Nothing is assumed from the ISA name. Candidate rule (``_judge``): a real
kernel (dequantize-then-matmul never counts) that is at most 1.2x slower than the dense baseline at
batch 1 and 2x at batch 32; the baseline and fp32 (the exact reference) always qualify.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from rich.table import Table
from torch import nn

from mcp2026 import hardware
from mcp2026.hardware import default_activation_dtype
from mcp2026.quant.linear import LINEAR_FORMATS
from mcp2026.quant.plan import FORMATS, INT4_GROUP_SIZES, WEIGHT_BITS, LayerQuantSpec

SCHEMA_VERSION = 1
# A quantized format must be at most this much slower than the dense baseline at each batch size.
# Batch 1 (decode) is where weight formats pay off; at batch 32 (prefill, batched decode) the int
# kernels are compute-bound, so they may cost more there without being useless.
SLOWDOWN_LIMITS = {1: 1.2, 32: 2.0}
DEFAULT_SLOWDOWN_LIMIT = 1.2
BUSY_LOAD = 1.5  # 1-minute load average above which CPU timings are not cached: this process + half a core
COMPUTE_DTYPES = {
    "fp32": (torch.float32,),
    "bf16": (torch.bfloat16,),
    "fp16": (torch.float16,),
    "int8": (torch.float32, torch.bfloat16, torch.float16),
    "int4": (torch.float32, torch.bfloat16, torch.float16),
    "fp8": (torch.bfloat16, torch.float32),
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class BenchSettings:
    """The micro-benchmark: one linear of (in_features -> out_features), SmolLM2's MLP up projection."""

    in_features: int = 576
    out_features: int = 1536
    batches: tuple[int, ...] = (1, 32)
    rounds: int = 7  # interleaved rounds; the fastest round counts (noisy neighbours only add time)
    target_s: float = 0.001  # time per format per round
    give_up_ratio: float = 8.0  # a first call this much slower than the baseline is not timed further
    cache_when_busy: bool = False  # see probe(): timings taken under load are not cached by default


@dataclass(frozen=True)
class FormatReport:
    format: str
    kernel: str | None  # the real kernel on this device, None where there is none
    has_kernel: bool  # kernel exists and the probe ran it
    compute_dtype: str | None  # fastest measured compute dtype
    bits_per_weight: dict[str, float]  # "g32" / "per_channel" / "dense" -> stored bits per weight
    timings_us: dict[str, dict[str, float]]  # compute dtype -> batch -> us per call, casts included
    speedup: dict[str, float]  # batch -> dense baseline us / best us of this format
    is_candidate: bool
    reason: str


@dataclass(frozen=True)
class BackendReport:
    key: str
    device: str
    description: str
    torch_version: str
    num_threads: int
    activation_dtype: str
    baseline_format: str
    baseline_us: dict[str, float]
    load_avg: float  # 1-minute load average when the probe started (this process included)
    formats: dict[str, FormatReport] = field(default_factory=dict)

    def candidates(self) -> tuple[str, ...]:
        """Candidate formats by weight bits, ties by batch-1 speed (fastest first)."""
        chosen = [r for r in self.formats.values() if r.is_candidate]
        return tuple(
            r.format for r in sorted(chosen, key=lambda r: (WEIGHT_BITS[r.format], -r.speedup.get("1", 0.0)))
        )

    @property
    def compute_dtypes(self) -> dict[str, torch.dtype]:
        """format -> fastest measured compute dtype (for ``linear.quantize_``)."""
        return {f: _DTYPES[r.compute_dtype] for f, r in self.formats.items() if r.compute_dtype}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BackendReport:
        data = json.loads(text)
        data["formats"] = {name: FormatReport(**r) for name, r in data["formats"].items()}
        return cls(**data)

    def to_table(self):
        batches = list(self.baseline_us)
        table = Table(
            title=f"{self.description} ({self.device}, {self.num_threads} threads, act {self.activation_dtype})"
        )
        for column in (
            "format",
            "kernel",
            "compute",
            "bits/weight",
            *[f"us b{b}" for b in batches],
            *[f"x b{b}" for b in batches],
            "candidate",
        ):
            table.add_column(column)
        for r in self.formats.values():
            us = [f"{r.timings_us[r.compute_dtype][b]:.0f}" if r.compute_dtype else "-" for b in batches]
            bits = " ".join(f"{k}:{v:.2f}" for k, v in r.bits_per_weight.items())
            table.add_row(
                r.format, r.kernel or "-", r.compute_dtype or "-", bits, *us,
                *[f"{r.speedup.get(b, 0):.2f}" for b in batches], "yes" if r.is_candidate else f"no: {r.reason}",
            )  # fmt: skip
        return table


# ---- device facts ----------------------------------------------------------------------------------
def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return hardware.cpu_model()


def machine_key(device: torch.device, settings: BenchSettings) -> str:
    """Cache key: device model, CPU flags, torch version, thread count, benchmark settings."""
    flags_hash = hashlib.sha256(" ".join(sorted(hardware.cpu_flags())).encode()).hexdigest()[:12]
    parts = [
        device.type,
        _describe(device),
        flags_hash,
        torch.__version__,
        str(torch.get_num_threads()),
        repr(settings),
        str(SCHEMA_VERSION),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


# ---- measuring ------------------------------------------------------------------------------------
def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_spec(fmt: str) -> LayerQuantSpec:
    return LayerQuantSpec(fmt, group_size=32) if fmt == "int4" else LayerQuantSpec(fmt)


def _bits(fmt: str, in_features: int) -> dict[str, float]:
    if fmt == "int4":
        return {f"g{g}": LayerQuantSpec("int4", g).bits_per_weight(in_features) for g in INT4_GROUP_SIZES}
    name = "dense" if WEIGHT_BITS[fmt] >= 16 else "per_channel"
    return {name: LayerQuantSpec(fmt).bits_per_weight(in_features)}


def _time_interleaved(
    fns: dict[str, Callable[[], object]], baseline: str, device, settings
) -> dict[str, float]:
    """us per call of each function: the fastest of several interleaved rounds (each the mean of a
    few calls), so load from other processes, which only adds time, biases no format."""
    first: dict[str, float] = {}
    for name, fn in fns.items():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        first[name] = time.perf_counter() - t0
    slow = {n for n, t in first.items() if t > settings.give_up_ratio * max(first[baseline], 1e-6)}
    iters = {n: max(1, int(settings.target_s / max(t, 1e-7))) for n, t in first.items()}
    samples: dict[str, list[float]] = {n: [] for n in fns if n not in slow}
    for _ in range(settings.rounds):
        for name in samples:
            t0 = time.perf_counter()
            for _ in range(iters[name]):
                fns[name]()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / iters[name])
    return {n: 1e6 * (min(samples[n]) if n in samples else first[n]) for n in fns}


def _build_modules(device: torch.device, settings: BenchSettings) -> dict[tuple[str, str], nn.Module]:
    """(format, compute dtype) -> module, for every pair whose construction and first call work."""
    torch.manual_seed(0)
    linear = nn.Linear(settings.in_features, settings.out_features, bias=False, device=device)
    x = torch.randn(1, settings.in_features, device=device)
    modules = {}
    for fmt in FORMATS:
        cls = LINEAR_FORMATS[fmt]
        if cls.kernel_on(device) is None:
            continue
        for dtype in COMPUTE_DTYPES[fmt]:
            try:
                module = cls.from_linear(linear, _bench_spec(fmt), compute_dtype=dtype)
                module(x.to(dtype))
            except (RuntimeError, NotImplementedError, ValueError, TypeError):
                continue  # this dtype (or the op) is not supported by this build on this device
            modules[(fmt, _DTYPE_NAMES[dtype])] = module
    return modules


def _judge(fmt: str, baseline_format: str, has_kernel: bool, speedup: dict[str, float]) -> tuple[bool, str]:
    """The candidate rule: a real kernel, and no slower than SLOWDOWN_LIMITS[batch] x the dense baseline
    at every measured batch size. The baseline itself and fp32 (the exact reference) always qualify."""
    if not has_kernel:
        return False, "no real kernel on this device"
    if fmt in (baseline_format, "fp32"):
        return True, "baseline" if fmt == baseline_format else "exact reference"
    for batch, ratio in speedup.items():
        limit = SLOWDOWN_LIMITS.get(int(batch), DEFAULT_SLOWDOWN_LIMIT)
        if 1.0 / max(ratio, 1e-9) > limit:
            return (
                False,
                f"{1.0 / ratio:.1f}x slower than {baseline_format} at batch {batch} (limit {limit}x)",
            )
    return True, "measured fast enough"


def measure(device: str | torch.device = "cpu", settings: BenchSettings = BenchSettings()) -> BackendReport:
    """Run the micro-benchmark now (about a second on a 2-core CPU) and return the report."""
    device = torch.device(device)
    load_avg = _load_avg()
    act_dtype = default_activation_dtype(device)
    baseline_format = _DTYPE_NAMES[act_dtype]
    modules = _build_modules(device, settings)
    timings: dict[tuple[str, str], dict[str, float]] = {key: {} for key in modules}
    with torch.inference_mode():
        for batch in settings.batches:
            x = torch.randn(batch, settings.in_features, device=device, dtype=act_dtype)
            fns = {f"{f}/{d}": (lambda m=m, x=x: m(x)) for (f, d), m in modules.items()}
            result = _time_interleaved(fns, f"{baseline_format}/{baseline_format}", device, settings)
            for fmt, dtype in modules:
                timings[(fmt, dtype)][str(batch)] = result[f"{fmt}/{dtype}"]
    baseline_us = timings[(baseline_format, baseline_format)]
    reports = {}
    for fmt in FORMATS:
        per_dtype = {d: t for (f, d), t in timings.items() if f == fmt}
        # the compute dtype with the best geometric-mean speed over the batch sizes
        best = min(
            per_dtype,
            key=lambda d: sum(math.log(per_dtype[d][b] / baseline_us[b]) for b in baseline_us),
            default=None,
        )
        speedup = {b: baseline_us[b] / per_dtype[best][b] for b in baseline_us} if best else {}
        kernel = LINEAR_FORMATS[fmt].kernel_on(device)
        is_candidate, reason = _judge(fmt, baseline_format, best is not None, speedup)
        reports[fmt] = FormatReport(
            fmt,
            kernel,
            best is not None,
            best,
            _bits(fmt, settings.in_features),
            per_dtype,
            speedup,
            is_candidate,
            reason,
        )
    return BackendReport(
        machine_key(device, settings), str(device), _describe(device), torch.__version__, torch.get_num_threads(),
        baseline_format, baseline_format, baseline_us, load_avg, reports,
    )  # fmt: skip


def probe(
    device: str | torch.device = "cpu", refresh: bool = False, settings: BenchSettings = BenchSettings()
) -> BackendReport:
    """The cached report for this machine and device (measured on first use or with ``refresh``).

    Cache: ``hardware.cache_dir()/backend.json`` (``MCP2026_CACHE_DIR`` overrides ~/.cache/mcp2026),
    one entry per ``machine_key``. NOTE: a report measured while other processes kept the CPU busy
    (1-minute load average above this process plus half a core) is returned but not cached: on a
    shared 2-core machine a busy neighbour slows 2-thread kernels 10-50x and would fix a wrong
    candidate set for good.
    """
    device = torch.device(device)
    key = machine_key(device, settings)
    path = hardware.cache_dir() / "backend.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        cached = {}
    if key in cached and not refresh:
        try:
            return BackendReport.from_json(json.dumps(cached[key]))
        except (TypeError, KeyError):
            pass  # written by another schema: measure again
    report = measure(device, settings)
    if device.type == "cpu" and report.load_avg > BUSY_LOAD and not settings.cache_when_busy:
        warnings.warn(f"CPU busy (load {report.load_avg:.1f}): backend timings not cached", stacklevel=2)
        return report
    cached[key] = json.loads(report.to_json())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    except OSError as error:
        warnings.warn(f"could not write the backend cache {path}: {error}", stacklevel=2)
    return report


def candidates(device: str | torch.device = "cpu") -> tuple[str, ...]:
    return probe(device).candidates()


def clamp_bits(bits: float, candidates: Sequence[str], strict: bool = False) -> str:
    """clampBitwidth: the candidate format whose weight width is nearest to ``bits``
    (ties go to the wider one; equal widths keep the order of ``candidates``). Warns naming both when the
    width differs; ``strict`` raises instead, listing the candidates."""
    if not candidates:
        raise ValueError("no candidate formats to clamp to")
    unknown = [c for c in candidates if c not in WEIGHT_BITS]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; known formats: {', '.join(FORMATS)}")
    chosen = min(candidates, key=lambda c: (abs(WEIGHT_BITS[c] - bits), -WEIGHT_BITS[c]))
    if WEIGHT_BITS[chosen] != bits:
        listing = ", ".join(f"{c} ({WEIGHT_BITS[c]} bits)" for c in candidates)
        message = f"{bits:g} bits is not a hardware candidate; nearest is {chosen} ({WEIGHT_BITS[chosen]} bits). Candidates: {listing}"
        if strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=2)
    return chosen
