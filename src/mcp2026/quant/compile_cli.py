"""The quantization YAML of ``mcp2026 compile`` / ``mcp-compile`` and ``Pipeline(config=spec)``: a
``CompileSpec`` (``mcp2026.compiler`` quantizes with it and writes the artifact).

YAML keys: the ``QuantConfig`` fields (target_precision, enable_dqg, bits_budget | bytes_budget |
max_ppl_increase, group_size, granularity, symmetric, int4_scale_bits, lm_head_precision, method, strict,
calibration_source, calibration_samples),
plus optional sections ``calibration:`` (CalibrationSettings: source, num_samples, max_len, min_len,
max_rows, fisher_samples, seed, ema_decay), ``dqg:`` (DQGSettings) and ``gptq:`` (GPTQSettings: damp, block_size,
act_order; with ``method: gptq``, or the default ``auto`` under the DQG) and ``learned:`` (LearnedScaleSettings: steps, lr, train_rows,
heldout_rows, heldout_share, seed; with ``method: learned``). Examples: examples/quant/*.yaml.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from mcp2026.config import QuantConfig
from mcp2026.quant.calibrate import CalibrationSettings
from mcp2026.quant.dqg_options import DQGSettings
from mcp2026.quant.gptq import GPTQSettings
from mcp2026.quant.learned_scales import LearnedScaleSettings

_QUANT_KEYS = {f.name for f in dataclasses.fields(QuantConfig)} - {"enable_dtss", "max_kv_cache_shards"}
_SECTIONS = {
    "calibration": CalibrationSettings, "dqg": DQGSettings, "gptq": GPTQSettings, "learned": LearnedScaleSettings,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """Everything a quantization YAML sets: the QuantConfig and the calibration and DQG settings. What
    ``compile`` quantizes with, and what ``Pipeline(config=spec)`` (so ``mcp2026 serve --quant``) uses."""

    quant: QuantConfig
    calibration: CalibrationSettings
    dqg: DQGSettings
    gptq: GPTQSettings = GPTQSettings()
    learned: LearnedScaleSettings = LearnedScaleSettings()

    @classmethod
    def from_config(cls, quant: QuantConfig) -> CompileSpec:
        """The settings a YAML holding only ``quant``'s fields gives (the defaults ``recipe`` falls back to)."""
        return cls(
            quant,
            CalibrationSettings(source=quant.calibration_source, num_samples=quant.calibration_samples),
            DQGSettings(symmetric_only=quant.symmetric),
        )


def _type_ok(value: Any, default: Any) -> bool:
    """Whether ``value`` fits a field whose default is ``default`` (bool is no number, int is a float)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int | float):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and (isinstance(value, int) or not isinstance(default, int))
    if isinstance(default, tuple):
        return isinstance(value, list | tuple) and all(_type_ok(v, 0.0) for v in value)
    return isinstance(value, type(default))


def _section(name: str, cls: type, value: Any) -> Any:
    """``cls`` from a YAML section; a ValueError names the key (``parse_spec`` prefixes the file)."""
    if value is None:  # an empty section: the defaults
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"'{name}' must be a mapping, got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"unknown keys in '{name}': {unknown}; known: {sorted(fields)}")
    for key, v in value.items():
        default = fields[key].default
        if default not in (None, dataclasses.MISSING) and not _type_ok(v, default):
            expected = "a list of numbers" if isinstance(default, tuple) else type(default).__name__
            raise ValueError(f"{name}.{key} must be {expected}, got {v!r}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})


def parse_spec(data: Any, source: str = "<yaml>") -> CompileSpec:
    """Validate a parsed YAML mapping; every problem is a ValueError naming ``source`` and the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - _QUANT_KEYS - set(_SECTIONS))
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; known: {sorted(_QUANT_KEYS | set(_SECTIONS))}")
    try:
        quant = QuantConfig(**{k: v for k, v in data.items() if k in _QUANT_KEYS})
        calibration = _section("calibration", CalibrationSettings, data.get("calibration"))
        settings = _section("dqg", DQGSettings, data.get("dqg"))
        gptq = _section("gptq", GPTQSettings, data.get("gptq"))
        learned = _section("learned", LearnedScaleSettings, data.get("learned"))
    except TypeError as error:  # a value of the wrong type reaching a dataclass
        raise ValueError(f"{source}: {error}") from None
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    flat = {"source": quant.calibration_source, "num_samples": quant.calibration_samples}
    given = data.get("calibration") or {}
    calibration = dataclasses.replace(calibration, **{k: v for k, v in flat.items() if k not in given})
    if "symmetric_only" not in (data.get("dqg") or {}):
        settings = dataclasses.replace(settings, symmetric_only=quant.symmetric)
    return CompileSpec(quant, calibration, settings, gptq, learned)


def load_spec(path: str | Path) -> CompileSpec:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise FileNotFoundError(f"{path}: cannot read the quantization config ({error.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path}: invalid YAML{where}: {problem}") from None
    return parse_spec(data, str(path))
