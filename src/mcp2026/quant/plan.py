"""QuantPlan: which weight format each linear layer gets, as ordered glob patterns with a ``_default``.

A plan is plain data (torchao's name-pattern -> config map): it round-trips through JSON, and its
``plan_id`` (a hash of the content) salts prefix caches so KV blocks never mix between plans.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass
from fnmatch import fnmatchcase
from typing import Any

from rich.table import Table
from torch import nn

# Bits per stored weight value, before scales and zero points.
WEIGHT_BITS: dict[str, int] = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
FORMATS: tuple[str, ...] = tuple(WEIGHT_BITS)
DENSE_FORMATS = ("fp32", "bf16", "fp16")
INT4_GROUP_SIZES = (32, 64, 128)
INT8_GROUP_SIZES = (32,)  # GGUF's Q8_0 blocks (a scale per 32 values), on the block GEMM
SCALE_BITS = 16  # scales and zero points are stored as fp16 (see quantizer.SCALE_DTYPE)
# int4 grids in 8 bits (``LayerQuantSpec.scale_bits`` 8): an 8-bit code per group's scale and zero, and per row two
# power-of-two steps stored as int8 exponents (quantizer.code_grids)
CODED_SCALE_BITS = 8
EXPONENT_BITS = 8
SCALE_BIT_CHOICES = (SCALE_BITS, CODED_SCALE_BITS)
INDEX_BITS = 32  # a split layer stores its int8 rows' indices as int32
BIAS_BITS = 32  # a correction bias is counted as fp32 (it is stored in the compute dtype)
SPLIT_ROW_MULTIPLE = 16  # the int4 kernel packs 16 output rows at a time, so the int8 rows come in 16s
DEFAULT_KEY = "_default"
# how int4 levels are chosen: round to nearest, GPTQ (quant/gptq.py), learned scales (quant/learned_scales.py)
METHODS = ("rtn", "gptq", "learned")
_METHOD_LABELS = {"gptq": "GPTQ", "learned": "learned scales"}
OUTPUT_PROJECTION = "lm_head"  # the models' vocabulary projection (its weight may be the tied embedding's)


@dataclass(frozen=True)
class LayerQuantSpec:
    """How one linear is stored. Fields that do not apply to the format are normalized away, so two
    specs that quantize identically compare (and hash) equal.

    ``clip_ratio``: a float in (0, 1] shrinks each group's (or channel's) range before rounding;
    "mse" searches the MSE-optimal ratio per group at quantization time.
    ``act_scale``: name of a per-input-channel scale vector (activation-aware scaling, AWQ) passed to
    ``quantize_``; the weight is multiplied by it and the module divides its input by it.
    ``high_rows`` (int4 only): this share of the output rows (rounded to 16s) is stored as int8 per channel
    instead, the rows ranked by the (N,) tensor named ``row_scores`` (default: each row's int4 weight error).
    Meant for a vocabulary projection, where a few thousand frequent tokens carry nearly all the probability.
    ``bias_correction``: name of the (K,) mean input from calibration; the module adds the bias
    ``-mean @ (Wq - W).T``, cancelling the quantization error's average effect on each output.
    ``method`` (int4 only): how the levels are chosen. "rtn" rounds each weight to its group's grid; "gptq"
    rounds column by column and spreads each column's error over the columns not yet rounded, weighted by the
    layer's input Hessian from calibration (``quant.gptq``; with ``high_rows``, the int4 rows, and a correction bias
    from the final weights); "learned" learns each group's scale and zero from
    round-to-nearest's on calibration inputs (``quant.learned_scales``). Same storage either way.
    ``scale_bits`` (int4 with zero points only): 16 stores each group's scale and zero in fp16; 8 stores each as an
    8-bit code on a power-of-two step per row (llama.cpp's k-quants quantize their scales likewise), 0.5 bits
    per weight less at g32. A weight on an fp16 grid of 32 loses nearly nothing to it (``quantizer.code_grids``).
    """

    format: str = "fp32"
    group_size: int | None = None  # int4: None means 32; int8: None is one scale per output channel
    symmetric: bool = False  # int4 only; int8 and fp8 are always symmetric
    clip_ratio: float | str = 1.0
    act_scale: str | None = None
    high_rows: float = 0.0
    row_scores: str | None = None
    bias_correction: str | None = None
    method: str = "rtn"
    scale_bits: int = SCALE_BITS

    def __post_init__(self) -> None:
        if self.format not in WEIGHT_BITS:
            raise ValueError(f"unknown weight format {self.format!r}; known formats: {', '.join(FORMATS)}")
        is_int4 = self.format == "int4"
        group = (self.group_size or 32) if is_int4 else self.group_size if self.format == "int8" else None
        if is_int4 and group not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        if self.format == "int8" and group not in (None, *INT8_GROUP_SIZES):
            raise ValueError(
                f"int8 group_size must be None (per output channel) or one of {INT8_GROUP_SIZES}, got "
                f"{self.group_size}: grouped int8 runs on the block GEMM, whose scales are per 32 values"
            )
        if isinstance(self.clip_ratio, str):
            if self.clip_ratio != "mse":
                raise ValueError(f"clip_ratio must be a float in (0, 1] or 'mse', got {self.clip_ratio!r}")
        elif not 0.0 < float(self.clip_ratio) <= 1.0:
            raise ValueError(f"clip_ratio must be in (0, 1], got {self.clip_ratio}")
        if self.format in DENSE_FORMATS and (
            self.act_scale is not None or self.clip_ratio != 1.0 or self.bias_correction is not None
        ):
            raise ValueError(
                f"{self.format} is not quantized: act_scale, clip_ratio and bias_correction do not apply"
            )
        if not 0.0 <= float(self.high_rows) < 1.0:
            raise ValueError(f"high_rows must be a share of the rows in [0, 1), got {self.high_rows}")
        if self.high_rows and not is_int4:
            raise ValueError(f"high_rows applies to int4 only (int8 rows inside int4), not {self.format}")
        if self.high_rows and self.act_scale is not None:
            raise ValueError("high_rows and act_scale cannot be combined (one input scale per split layer)")
        if self.row_scores is not None and not self.high_rows:
            raise ValueError("row_scores ranks the rows of high_rows; set high_rows > 0 or drop row_scores")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.method == "gptq" and (not is_int4 or self.act_scale is not None):
            raise ValueError(
                f"method 'gptq' applies to int4 layers without act_scale, not {self.format}"
                + (" with an act_scale" if is_int4 else "")
            )
        if self.method == "learned" and (
            not is_int4 or self.high_rows or self.act_scale is not None or self.bias_correction is not None
        ):
            raise ValueError(
                "method 'learned' applies to plain int4 layers (no high_rows, act_scale or bias_correction), "
                f"not {self.format}" + (" with those" if is_int4 else "")
            )
        if self.scale_bits not in SCALE_BIT_CHOICES:
            raise ValueError(f"scale_bits must be one of {SCALE_BIT_CHOICES}, got {self.scale_bits!r}")
        if self.scale_bits != SCALE_BITS:
            if not is_int4 or self.symmetric:
                raise ValueError(
                    f"scale_bits={self.scale_bits} applies to int4 with zero points (symmetric: false) only, "
                    f"not {self.format}" + (" symmetric" if is_int4 else "")
                )
            if self.method == "learned":
                raise ValueError(
                    "learned scales are fp16 per group; use scale_bits 16 with method learned, or rtn / gptq"
                )
        object.__setattr__(self, "high_rows", float(self.high_rows))
        object.__setattr__(self, "group_size", group)
        object.__setattr__(
            self, "symmetric", bool(self.symmetric) if is_int4 else self.format in ("int8", "fp8")
        )
        if not isinstance(self.clip_ratio, str):
            object.__setattr__(self, "clip_ratio", float(self.clip_ratio))

    @property
    def weight_bits(self) -> int:
        return WEIGHT_BITS[self.format]

    def bits_per_weight(self, in_features: int, out_features: int | None = None) -> float:
        """Stored bits per weight, scales and zero points included (bf16 each).

        int4 keeps a scale and a zero per group even when symmetric (the kernel's layout), so
        g32 = 4 + 32/32 = 5.0, g64 = 4.5, g128 = 4.25; with 8-bit scales 4 + 16/g + 16/K (g32, K = 576: 4.53);
        int8/fp8 keep one scale per output channel (grouped int8: one per group, 8.5 at g32).
        A split int4 layer's int8 rows cost 8 + (16-bit scale + 32-bit row index) / K each (their exact
        number needs ``out_features``; without it the share is ``high_rows``); a correction bias 32 / K.
        """
        bias = BIAS_BITS / in_features if self.bias_correction is not None else 0.0
        if self.format == "int4":
            low = 4 + 2 * self.scale_bits / self.group_size
            if self.scale_bits != SCALE_BITS:  # the row's two exponents
                low += 2 * EXPONENT_BITS / in_features
            share = self.high_rows
            if out_features is not None and share:
                share = high_row_count(out_features, share) / out_features
            return low + share * (8 + (SCALE_BITS + INDEX_BITS) / in_features - low) + bias
        if self.format in ("int8", "fp8"):
            return 8 + SCALE_BITS / (self.group_size or in_features) + bias
        return float(self.weight_bits)

    def describe(self) -> str:
        """One readable phrase, e.g. "int4 g64 asym, 15% of rows int8, bias-corrected"."""
        text = self.format
        if self.format == "int4":
            text += f" g{self.group_size} {'sym' if self.symmetric else 'asym'}"
        elif self.group_size:
            text += f" g{self.group_size}"
        extras = [
            "8-bit scales" if self.scale_bits != SCALE_BITS else "",
            f"{self.high_rows:.0%} of rows int8" if self.high_rows else "",
            f"clip {self.clip_ratio}" if self.clip_ratio != 1.0 else "",
            "AWQ-scaled" if self.act_scale else "",
            "bias-corrected" if self.bias_correction else "",
            _METHOD_LABELS.get(self.method, ""),
        ]
        return ", ".join([text, *filter(None, extras)])

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``method`` and ``scale_bits`` only when not the default, so a plan that uses neither has the
        JSON and the id of a plan without those fields."""
        out = asdict(self)
        if out["method"] == "rtn":
            del out["method"]
        if out["scale_bits"] == SCALE_BITS:
            del out["scale_bits"]
        return out


def high_row_count(out_features: int, share: float) -> int:
    """Rows a split layer keeps in int8: ``share`` of ``out_features`` rounded to a multiple of 16, leaving
    at least 16 rows of int4."""
    k = round(share * out_features / SPLIT_ROW_MULTIPLE) * SPLIT_ROW_MULTIPLE
    return max(0, min(k, out_features - SPLIT_ROW_MULTIPLE))


def _as_spec(value: LayerQuantSpec | Mapping[str, Any] | str) -> LayerQuantSpec:
    if isinstance(value, LayerQuantSpec):
        return value
    if isinstance(value, str):
        return LayerQuantSpec(format=value)
    known = {f.name for f in fields(LayerQuantSpec)}
    unknown = set(value) - known
    if unknown:
        raise ValueError(f"unknown LayerQuantSpec fields {sorted(unknown)}; known: {sorted(known)}")
    return LayerQuantSpec(**value)


def _is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a quantized linear (``linear.QuantLinear``): each carries its LayerQuantSpec as
    ``spec``. Asked that way because linear.py imports this module."""
    return isinstance(getattr(module, "spec", None), LayerQuantSpec)


def _outer_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` without the submodules of a quantized module (a split layer's int8 and int4
    halves are part of it: counting or listing them again would count the layer twice)."""
    inside: str | None = None
    for name, module in model.named_modules():  # pre-order: a module's children come right after it
        if inside is not None and name.startswith(inside):
            continue
        if _is_quantized(module):
            inside = name + "."
        yield name, module


def linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) for every nn.Linear or already-quantized linear in the model (a quantized
    module's own submodules are not listed)."""
    for name, module in _outer_modules(model):
        if isinstance(module, nn.Linear) or _is_quantized(module):
            yield name, module


def layer_bits(model: nn.Module) -> dict[str, float]:
    """Stored bits per weight of each linear as the model holds it now (scales and zeros included)."""
    bits = {}
    for name, module in linear_modules(model):
        per_weight = getattr(module, "bits_per_weight", None)
        bits[name] = float(per_weight) if per_weight is not None else float(module.weight.element_size() * 8)
    return bits


class QuantPlan:
    """Ordered ``pattern -> LayerQuantSpec``; the first matching glob wins, then ``_default``.

    A layer that matches nothing (and no ``_default``) is left as it is. Immutable after construction.
    """

    __slots__ = ("_default", "_rules")

    def __init__(self, rules: Mapping[str, LayerQuantSpec | Mapping[str, Any] | str]) -> None:
        specs = {pattern: _as_spec(spec) for pattern, spec in rules.items()}
        self._default: LayerQuantSpec | None = specs.pop(DEFAULT_KEY, None)
        self._rules: tuple[tuple[str, LayerQuantSpec], ...] = tuple(specs.items())

    @classmethod
    def uniform(cls, fmt: str, **kwargs: Any) -> QuantPlan:
        return cls({DEFAULT_KEY: LayerQuantSpec(format=fmt, **kwargs)})

    @property
    def rules(self) -> tuple[tuple[str, LayerQuantSpec], ...]:
        return self._rules

    @property
    def default(self) -> LayerQuantSpec | None:
        return self._default

    def spec_for(self, name: str) -> LayerQuantSpec | None:
        for pattern, spec in self._rules:
            if fnmatchcase(name, pattern):
                return spec
        return self._default

    def layer_specs(self, model: nn.Module) -> dict[str, LayerQuantSpec | None]:
        return {name: self.spec_for(name) for name, _ in linear_modules(model)}

    # ---- serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        out = {pattern: spec.to_dict() for pattern, spec in self._rules}
        if self._default is not None:
            out[DEFAULT_KEY] = self._default.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps({"version": 1, "rules": self.to_dict()}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> QuantPlan:
        data = json.loads(text)
        return cls(data.get("rules", data))

    @property
    def plan_id(self) -> str:
        """Stable 16-hex-digit hash of the content (rule order matters: first match wins)."""
        canonical = json.dumps(list(self.to_dict().items()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, QuantPlan) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.plan_id)

    def __repr__(self) -> str:
        return f"QuantPlan({self.to_dict()!r})"

    # ---- size accounting ----------------------------------------------------------------------
    def _linear_bits(self, name: str, module: nn.Module) -> tuple[int, float]:
        """(number of weights, stored bits per weight) for one linear under this plan."""
        if _is_quantized(module):  # already quantized: it knows its own format
            return module.in_features * module.out_features, float(module.bits_per_weight)
        spec = self.spec_for(name)
        if spec is None:
            return module.weight.numel(), float(module.weight.element_size() * 8)
        return module.weight.numel(), spec.bits_per_weight(module.in_features, module.out_features)

    def avg_bits_per_weight(self, model: nn.Module) -> float:
        """Average stored bits per linear weight (scales and zeros included), weighted by size."""
        total_weights, total_bits = 0, 0.0
        for name, module in linear_modules(model):
            count, bits = self._linear_bits(name, module)
            total_weights += count
            total_bits += count * bits
        return total_bits / max(total_weights, 1)

    def _changes(self, name: str, module: nn.Module) -> bool:
        """Whether the plan stores this linear differently from how it is stored now."""
        if _is_quantized(module):
            return True
        spec = self.spec_for(name)
        if spec is None:
            return False
        return not (spec.format in DENSE_FORMATS and spec.weight_bits == module.weight.element_size() * 8)

    def total_bytes(self, model: nn.Module) -> int:
        """Bytes of all weights once the plan is applied: changed linears as planned, every other
        parameter or buffer as it is now. A tensor shared by several modules (a tied embedding) counts
        once; a tied lm_head that gets quantized adds its quantized copy (the embedding keeps its own)."""
        planned_bytes = 0.0
        storages: dict[int, int] = {}
        for name, module in _outer_modules(model):  # a quantized module's submodules are in its bits
            is_linear = isinstance(module, nn.Linear) or _is_quantized(module)
            if is_linear and self._changes(name, module):
                count, bits = self._linear_bits(name, module)
                bias = getattr(module, "bias", None)
                spec = module.spec if _is_quantized(module) else self.spec_for(name)
                if spec is not None and spec.bias_correction is not None:
                    bias = None  # counted in its bits per weight
                planned_bytes += count * bits / 8 + (
                    0 if bias is None else bias.numel() * bias.element_size()
                )
                continue
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return int(planned_bytes) + sum(storages.values())

    # ---- rendering -----------------------------------------------------------------------------
    def to_table(self, stats: Mapping[str, Any] | None = None):
        """A rich Table: one row per rule, or one row per layer in ``stats`` (name -> WeightStats or dict)
        with its resolved spec and the statistics as extra columns."""
        table = Table(title=f"QuantPlan {self.plan_id}")
        spec_columns = ("format", "group", "sym", "clip", "act_scale")
        if stats is None:
            table.add_column("pattern")
            for column in spec_columns:
                table.add_column(column)
            rows = [*self._rules, *([(DEFAULT_KEY, self._default)] if self._default else [])]
            for pattern, spec in rows:
                table.add_row(pattern, *_spec_cells(spec))
            return table
        rows = {name: _stat_row(s) for name, s in stats.items()}
        stat_columns = list(next(iter(rows.values()), {}))
        table.add_column("layer")
        for column in (*spec_columns, *stat_columns):
            table.add_column(column, justify="right" if column in stat_columns else "left")
        for name, row in rows.items():
            cells = [_fmt(row.get(column)) for column in stat_columns]
            table.add_row(name, *_spec_cells(self.spec_for(name)), *cells)
        return table


def _spec_cells(spec: LayerQuantSpec | None) -> list[str]:
    if spec is None:
        return ["(unchanged)", "", "", "", ""]
    extras = [
        f"+{spec.high_rows:.0%} rows int8" if spec.high_rows else "",
        "+bias corr" if spec.bias_correction else "",
    ]
    extras.append(_METHOD_LABELS.get(spec.method, ""))
    return [
        " ".join([spec.format, *filter(None, extras)]),
        str(spec.group_size or ""),
        "y" if spec.symmetric else "n",
        str(spec.clip_ratio),
        spec.act_scale or "",
    ]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _stat_row(stats: Any) -> dict[str, Any]:
    row = asdict(stats) if is_dataclass(stats) else dict(stats)
    if hasattr(stats, "needs_precompensation"):
        row["precompensate"] = "yes" if stats.needs_precompensation else ""
    return row
