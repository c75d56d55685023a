"""Benchmark plugins: custom measurements that run like built-in benchmarks and record a ``BenchRun``.

A plugin is a class with ``init(ctx)`` (set up: build requests, warm up) and ``run(ctx) -> dict[str, float]``
(measure). It is found by ``module:Class`` (or ``path/to/file.py:Class``) or by name through the entry point
group ``mcp2026.bench_plugins``::

    [project.entry-points."mcp2026.bench_plugins"]
    prefix-hit-rate = "my_benchmarks.prefix:PrefixCacheHitRate"

Errors inside a plugin, and results that are not numbers, become one-line ``PluginError``s naming the plugin.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.workloads import WorkloadSpec, load_workload
from mcp2026.pipeline import Pipeline

if TYPE_CHECKING:
    from mcp2026.bench.workloads import BenchRequest

ENTRY_POINT_GROUP = "mcp2026.bench_plugins"


class PluginError(ValueError):
    """A plugin could not be found, loaded or run, or returned something other than numbers."""


@dataclass(frozen=True)
class PluginContext:
    """What a plugin gets: the model to measure and run settings. The pipeline is built on first use."""

    model: str | None = None  # HF folder, .gguf or artifact; None: the embedded default model
    dtype: str = "auto"
    seed: int = 0
    out_dir: Path | None = None  # where the plugin may write files of its own
    params: Mapping[str, str] = field(default_factory=dict)  # --param KEY=VALUE, for the plugin to read

    @cached_property
    def pipeline(self) -> Pipeline:
        return Pipeline(self.model, dtype=self.dtype)

    def workload(self, name: str, num_requests: int, **spec: Any) -> list[BenchRequest]:
        """Requests of a registered workload (bench/workloads.py) for this model's tokenizer and vocabulary,
        seeded by ``seed``; ``spec`` sets other WorkloadSpec fields (input_len, output_len, prefix_len)."""

        pipe = self.pipeline
        workload = WorkloadSpec(name, num_requests, self.seed, **spec)
        return load_workload(workload, pipe.tokenizer, pipe.loaded.config.vocab_size)

    def param(self, key: str, default: str | None = None) -> str | None:
        return self.params.get(key, default)


@runtime_checkable
class BenchPlugin(Protocol):
    def init(self, ctx: PluginContext) -> None: ...

    def run(self, ctx: PluginContext) -> dict[str, float]: ...


def available_plugins() -> dict[str, str]:
    """Installed plugins: entry point name -> ``module:Class``."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _import_target(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise PluginError(f"plugin {spec!r}: expected module:Class or path/to/file.py:Class")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise PluginError(f"plugin {spec!r}: {path} is not a file")
            unique = f"mcp2026_bench_plugin_{path.stem}"
            loader_spec = importlib.util.spec_from_file_location(unique, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[unique] = module  # dataclasses and pickling look the module up by name
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken plugin module is one line, not a traceback
        raise PluginError(f"plugin {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"plugin {spec!r}: {module_name} has no attribute {attr!r}") from None


def load_plugin(name_or_spec: str) -> tuple[str, BenchPlugin]:
    """(name, instance) for ``module:Class``, ``file.py:Class`` or an installed entry point's name."""
    if ":" in name_or_spec:
        target, name = _import_target(name_or_spec), name_or_spec
    else:
        found = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == name_or_spec]
        if not found:
            known = ", ".join(sorted(available_plugins())) or "none installed"
            raise PluginError(
                f"no benchmark plugin named {name_or_spec!r} (installed: {known}); "
                "give module:Class or path/to/file.py:Class"
            )
        try:
            target, name = found[0].load(), name_or_spec
        except Exception as e:  # noqa: BLE001
            raise PluginError(f"plugin {name_or_spec!r}: cannot load {found[0].value} ({e})") from None
    try:
        plugin = target() if isinstance(target, type) else target
    except Exception as e:  # noqa: BLE001
        raise PluginError(f"plugin {name}: constructing it failed ({type(e).__name__}: {e})") from None
    if not isinstance(plugin, BenchPlugin):
        raise PluginError(f"plugin {name}: needs methods init(ctx) and run(ctx) -> dict[str, float]")
    return name, plugin


def _check_metrics(name: str, result: Any) -> dict[str, float]:
    if not isinstance(result, Mapping) or not result:
        raise PluginError(
            f"plugin {name}: run() must return a non-empty dict[str, float], got {result!r:.80}"
        )
    metrics = {}
    for key, value in result.items():
        if not isinstance(key, str):
            raise PluginError(f"plugin {name}: metric names must be strings, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PluginError(f"plugin {name}: metric {key!r} is {value!r:.60}, not a finite number")
        metrics[key] = float(value)
    return metrics


def run_plugin(name: str, plugin: BenchPlugin, ctx: PluginContext, command: str = "") -> BenchRun:
    """``init`` then ``run``, timed; a ``BenchRun`` (kind "plugin") with one record per metric."""
    seconds = {}
    for phase in ("init", "run"):
        t0 = time.perf_counter()
        try:
            result = getattr(plugin, phase)(ctx)
        except Exception as e:  # noqa: BLE001 - plugin code: report it as one line naming the plugin
            raise PluginError(f"plugin {name} failed in {phase}(): {type(e).__name__}: {e}") from None
        seconds[f"{phase}_s"] = time.perf_counter() - t0
    metrics = _check_metrics(name, result)
    config = {**asdict(ctx), "plugin": name, "params": dict(ctx.params), "out_dir": str(ctx.out_dir or "")}
    return BenchRun(
        kind="plugin",
        command=command or f"mcp2026 bench plugin {name}",
        config=config,
        records=[{"metric": k, "value": v} for k, v in metrics.items()],
        aggregates={"metrics": metrics, **seconds},
        tables=[Table(f"plugin {name}", ["metric", "value"], [[k, v] for k, v in metrics.items()])],
        notes=[f"init {seconds['init_s']:.2f} s, run {seconds['run_s']:.2f} s"],
        machine=machine_info(),
    )
