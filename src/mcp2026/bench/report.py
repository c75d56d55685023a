"""Benchmark results: one ``BenchRun`` per run (machine, command, config, per-request records, aggregates,
tables), written as JSON + markdown under runs/, and spliced into docs/benchmarks.md between markers.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from mcp2026 import hardware

# CPU flags that decide which kernels are fast (bf16 GEMM, VNNI int8, AMX).
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
)
_SECTION = re.compile(r"^[A-Za-z0-9_.-]+$")


def project_root() -> Path:
    """The source checkout this package runs from (editable install), else the current directory."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def git_commit(root: Path | None = None) -> dict[str, Any]:
    root = root or project_root()

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status)}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU and its SIMD flags, cores, memory, library versions, git commit."""

    flags = hardware.cpu_flags()
    return {
        "cpu_model": hardware.cpu_model(),
        "cpu_family_model": hardware.cpu_family_model(),
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "fast_bf16": hardware.has_fast_bf16(),
        "usable_cores": hardware.usable_cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "available_memory_gb": round(hardware.available_memory_bytes() / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama_cpp_python"),
        "mcp2026": _version("mcp2026"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git": git_commit(),
    }


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class BenchRun:
    """One benchmark run. ``command`` is the CLI line that reproduces it; ``argv`` what actually ran."""

    kind: str  # "latency" | "offline" | ...
    command: str
    config: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)  # one per request or measurement
    aggregates: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    argv: list[str] = field(default_factory=lambda: list(sys.argv))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchRun:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["tables"] = [Table(**t) for t in values.get("tables", [])]
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    @classmethod
    def from_json(cls, text: str) -> BenchRun:
        return cls.from_dict(json.loads(text))


def format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value)
    if isinstance(value, float):
        if value != value:  # NaN
            return "—"
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def markdown_table(table: Table) -> str:
    lines = [
        "| " + " | ".join(table.columns) + " |",
        "|" + "|".join("---" for _ in table.columns) + "|",
        *("| " + " | ".join(format_value(v) for v in row) + " |" for row in table.rows),
    ]
    return "\n".join(lines)


def machine_line(machine: dict[str, Any]) -> str:
    if not machine:
        return "machine: unknown"
    flags = ", ".join(f for f, on in machine.get("cpu_flags", {}).items() if on) or "none of the tracked"
    git = machine.get("git") or {}
    commit = (git.get("commit") or "unknown")[:10] + (" (dirty)" if git.get("dirty") else "")
    family = f" ({machine['cpu_family_model']})" if machine.get("cpu_family_model") else ""
    return (
        f"{machine.get('cpu_model')}{family}, {machine.get('usable_cores')} cores ({machine.get('torch_threads')} torch "
        f"threads), flags: {flags}; torch {machine.get('torch')}, transformers {machine.get('transformers')}; "
        f"commit {commit}"
    )


def render_markdown(run: BenchRun, heading: str = "###") -> str:
    parts = []
    for table in run.tables:
        parts += [f"{heading} {table.title}", "", markdown_table(table), ""]
    parts += [f"- {note}" for note in run.notes]
    if run.notes:
        parts.append("")
    parts += [
        f"Command: `{run.command}`",
        "",
        f"Machine: {machine_line(run.machine)}; run {run.created_at}.",
    ]
    return "\n".join(parts).rstrip() + "\n"


def write_run(run: BenchRun, runs_dir: Path | None = None) -> Path:
    """Write ``runs/<time>-<kind>.json`` and the same name ``.md``; returns the JSON path."""
    runs_dir = Path(runs_dir) if runs_dir is not None else project_root() / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = runs_dir / f"{stamp}-{run.kind}"
    n = 1
    while base.with_suffix(".json").exists():
        n += 1
        base = runs_dir / f"{stamp}-{run.kind}-{n}"
    json_path = base.with_suffix(".json")
    json_path.write_text(run.to_json())
    base.with_suffix(".md").write_text(f"# {run.kind} benchmark\n\n" + render_markdown(run))
    return json_path


def read_run(path: Path) -> BenchRun:
    return BenchRun.from_json(Path(path).read_text())


def read_benchmarks_section(section: str, path: Path | None = None) -> str:
    """The text between the section's markers in docs/benchmarks.md; "" when the file or section is not there."""
    path = Path(path) if path is not None else project_root() / "docs" / "benchmarks.md"
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""
    match = re.search(re.escape(start) + r"(.*?)" + re.escape(end), text, re.DOTALL)
    return match.group(1) if match else ""


def update_benchmarks_md(section: str, markdown: str, path: Path | None = None) -> Path:
    """Replace the text between ``<!-- bench:SECTION -->`` and ``<!-- /bench:SECTION -->`` in
    docs/benchmarks.md (appending the section, or creating the file, when it is not there yet)."""
    if not _SECTION.match(section):
        raise ValueError(f"section names are letters, digits, '.', '_' and '-', got {section!r}")
    path = Path(path) if path is not None else project_root() / "docs" / "benchmarks.md"
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def shell_join(args: list[str]) -> str:
    return shlex.join(args)
