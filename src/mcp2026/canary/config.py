"""``CanaryConfig``: the ``canary:`` section of a serve YAML. Threshold keys (flat, as in ``Thresholds``)
override the decision matrix; the live keys turn ``mcp2026 serve`` into a canary deployment.

```yaml
canary:
  latency_safe_ms: 15        # any Thresholds field
  candidate: int8.yaml       # live: the candidate's serve YAML (relative to this file)
  candidate_share: 0.1       # live: share of tenants routed to the candidate (fixed: observe only)
  ramp: [0.1, 0.25, 0.5, 1.0]   # live, instead: the shares the verdict walks up (starting at the first)
  evaluate_every_s: 60       # live with a ramp: how often the verdict may shift the share
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mcp2026.canary.gate import Thresholds

BASELINE, CANDIDATE = "baseline", "candidate"  # the arms' names in reports, metrics and routes

THRESHOLD_KEYS = frozenset(f.name for f in dataclasses.fields(Thresholds))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


DEFAULT_CANDIDATE_SHARE = 0.1
RAMP_EXAMPLE = "[0.1, 0.25, 0.5, 1.0]"


def _ramp_steps(raw: Any) -> tuple[float, ...]:
    """The ``ramp:`` list as shares, checked: at least two, strictly increasing, from (0, 1) up to 1.0."""
    _require(
        isinstance(raw, (list, tuple)),
        f"canary.ramp must be a list of shares, e.g. {RAMP_EXAMPLE}, got {raw!r}",
    )
    for x in raw:
        _require(
            isinstance(x, (int, float)) and not isinstance(x, bool),
            f"canary.ramp must hold numbers (shares of tenants), got {x!r}; e.g. {RAMP_EXAMPLE}",
        )
    steps = tuple(float(x) for x in raw)
    if not steps:
        return steps
    _require(
        len(steps) >= 2,
        f"canary.ramp needs a first share and at least one step after it, e.g. {RAMP_EXAMPLE}, got {list(steps)}",
    )
    _require(
        all(a < b for a, b in zip(steps, steps[1:])),
        f"canary.ramp must increase step by step, got {list(steps)}",
    )
    _require(0 < steps[0] < 1, f"canary.ramp must start in (0, 1), got {steps[0]}")
    _require(
        steps[-1] == 1.0,
        f"canary.ramp must end at 1.0 (the candidate serves everyone once promoted), got {steps[-1]}",
    )
    return steps


@dataclass(frozen=True)
class CanaryConfig:
    threshold_overrides: tuple[tuple[str, float], ...] = ()  # only the keys given, so configs can merge
    candidate: str | None = None  # live: the candidate's serve YAML; None = no live canary
    # live: share of the sticky keys (tenants) routed to the candidate; None: the ramp's first step, else 0.1
    candidate_share: float | None = None
    # live: the shares a PROMOTE walks up, the first one served at start; empty = the share stays fixed and
    # the verdict is only observed
    ramp: tuple[float, ...] = ()
    evaluate_every_s: float = 60.0  # live with a ramp: at least this long between two verdicts that shift
    salt: str = "mcp2026-canary"  # live: hashed with the tenant id; change it to reshuffle who is routed
    window: int = 512  # live: latest finished requests per arm that the P99s and their intervals use
    offline_report: str | None = None  # live: an offline canary report JSON whose accuracy metric counts

    def __post_init__(self) -> None:
        object.__setattr__(self, "threshold_overrides", tuple(sorted(dict(self.threshold_overrides).items())))
        self.thresholds  # noqa: B018 - validates the overrides where they are written
        object.__setattr__(self, "ramp", _ramp_steps(self.ramp))
        if self.candidate_share is None:
            object.__setattr__(
                self, "candidate_share", self.ramp[0] if self.ramp else DEFAULT_CANDIDATE_SHARE
            )
        _require(
            isinstance(self.candidate_share, (int, float)) and not isinstance(self.candidate_share, bool),
            f"canary.candidate_share must be a number in (0, 1), got {self.candidate_share!r}",
        )
        _require(
            not self.ramp or self.candidate_share == self.ramp[0],
            f"canary.candidate_share ({self.candidate_share}) differs from the ramp's first step "
            f"({self.ramp[0] if self.ramp else None}): with a ramp the share starts at canary.ramp[0]; drop "
            "candidate_share (and --candidate-share) or make it the ramp's first entry",
        )
        _require(
            0 < self.candidate_share < 1,
            f"canary.candidate_share must be in (0, 1), got {self.candidate_share}",
        )
        _require(self.window >= 1, f"canary.window must be >= 1, got {self.window}")
        _require(
            isinstance(self.evaluate_every_s, (int, float))
            and not isinstance(self.evaluate_every_s, bool)
            and self.evaluate_every_s > 0,
            f"canary.evaluate_every_s must be a number of seconds > 0, got {self.evaluate_every_s!r}",
        )
        _require(bool(self.salt), "canary.salt must not be empty")

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds.from_mapping(dict(self.threshold_overrides), "canary")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None, source: str = "canary") -> CanaryConfig:
        raw = dict(raw or {})
        _require(all(isinstance(k, str) for k in raw), f"{source}: canary keys must be strings")
        overrides = {k: raw.pop(k) for k in list(raw) if k in THRESHOLD_KEYS}
        Thresholds.from_mapping(overrides, source)
        known = {f.name for f in dataclasses.fields(cls)} - {"threshold_overrides"}
        unknown = sorted(set(raw) - known)
        _require(
            not unknown, f"{source}: unknown canary keys {unknown}; known: {sorted(known | THRESHOLD_KEYS)}"
        )
        try:
            return cls(threshold_overrides=tuple(overrides.items()), **raw)
        except TypeError as e:
            raise ValueError(f"{source}: {e}") from None

    def with_live_options(self, candidate: str | Path | None, candidate_share: float | None) -> CanaryConfig:
        """``mcp2026 serve --canary-config B.yaml --candidate-share 0.1`` over the YAML's ``canary:``."""
        fields: dict[str, Any] = {}
        if candidate is not None:
            fields["candidate"] = str(candidate)
        if candidate_share is not None:
            _require(
                (candidate or self.candidate) is not None,
                "--candidate-share needs a candidate: pass --canary-config B.yaml (a serve YAML)",
            )
            fields["candidate_share"] = candidate_share
        return dataclasses.replace(self, **fields)

    def with_paths_under(self, base: Path) -> CanaryConfig:
        """File paths in a YAML are relative to the YAML's folder."""
        fields = {}
        for key in ("candidate", "offline_report"):
            value = getattr(self, key)
            if value is not None and not Path(value).expanduser().is_absolute():
                fields[key] = str(base / value)
        return dataclasses.replace(self, **fields)


def read_thresholds_file(path: str | Path) -> dict[str, float]:
    """A thresholds YAML: the Thresholds keys at the top level or under ``canary:``."""

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: thresholds file not found") from None
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read the thresholds ({e})") from None
    _require(isinstance(raw, dict), f"{path}: the thresholds file must be a mapping of keys to numbers")
    if isinstance(raw.get("canary"), dict) and len(raw) == 1:
        raw = raw["canary"]
    Thresholds.from_mapping(raw, str(path))
    return dict(raw)
