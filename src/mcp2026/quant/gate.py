"""The runtime gate: one model, two plans (quality and pressure), switched between engine steps.

Layers both plans store alike share one module; only the layers that differ are held twice. A switch
swaps those modules in place. ``switch`` is for a caller between steps (the engine loop); ``request``
may come from any thread (the server's traffic signal) and takes effect at the start of the next model
forward, so a step never mixes plans. NOTE: KV blocks computed under one plan are reused under the
other after a switch (the prefix cache is not re-salted); the switch trades that for staying hot.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from mcp2026.quant.linear import build_linear
from mcp2026.quant.plan import DENSE_FORMATS, LayerQuantSpec, QuantPlan
from mcp2026.quant.quant_linear import QuantLinear

PLANS = ("quality", "pressure")


def _module_for(
    name: str,
    linear: nn.Linear,
    spec: LayerQuantSpec | None,
    tensors: Mapping[str, Tensor],
    compute_dtypes: Mapping[str, torch.dtype],
) -> nn.Module:
    if spec is None or (
        spec.format in DENSE_FORMATS and QuantLinear.dtype_of(spec.format) == linear.weight.dtype
    ):
        return linear
    return build_linear(name, linear, spec, compute_dtypes.get(spec.format), tensors)


class QuantGate:
    """Holds ``quality_plan`` and ``pressure_plan`` for ``model`` (given unquantized) and installs the
    quality plan. ``tensors`` / ``compute_dtypes`` as for ``linear.quantize_`` (both plans' tensors)."""

    def __init__(
        self,
        model: nn.Module,
        quality_plan: QuantPlan,
        pressure_plan: QuantPlan,
        tensors: Mapping[str, Tensor] | None = None,
        compute_dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.model = model
        self.plans = {"quality": quality_plan, "pressure": pressure_plan}
        self._current = "quality"
        self._pending: str | None = None
        self._lock = threading.Lock()
        self.num_switches = 0
        scales, dtypes = tensors or {}, compute_dtypes or {}
        self._modules: dict[str, dict[str, nn.Module]] = {}  # only the layers whose specs differ
        for name, linear in list(model.named_modules()):
            if not isinstance(linear, nn.Linear):
                continue
            specs = {p: plan.spec_for(name) for p, plan in self.plans.items()}
            quality = _module_for(name, linear, specs["quality"], scales, dtypes)
            if specs["pressure"] != specs["quality"]:
                self._modules[name] = {
                    "quality": quality,
                    "pressure": _module_for(name, linear, specs["pressure"], scales, dtypes),
                }
            self._install(name, quality)
        self._hook = model.register_forward_pre_hook(lambda _m, _a: self._apply_pending())

    @property
    def current(self) -> str:
        return self._current

    @property
    def differing_layers(self) -> list[str]:
        return list(self._modules)

    @property
    def extra_bytes(self) -> int:
        """Bytes held for the plan that is not installed (what holding both costs)."""
        idle = "pressure" if self._current == "quality" else "quality"
        return sum(_nbytes(pair[idle]) for pair in self._modules.values())

    def _install(self, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent), child, module)

    def switch(self, to: str) -> bool:
        """Install plan ``to`` now (call between steps; drops any pending request). Returns whether
        anything changed."""
        _check(to)
        with self._lock:
            self._pending = None
            return self._install_plan(to)

    def request(self, to: str) -> None:
        """Ask for plan ``to`` from any thread; installed before the next forward pass."""
        _check(to)
        with self._lock:
            self._pending = to

    def _apply_pending(self) -> None:
        with self._lock:
            to, self._pending = self._pending, None
            if to is not None:
                self._install_plan(to)

    def _install_plan(self, to: str) -> bool:  # the caller holds the lock
        if to == self._current:
            return False
        for name, pair in self._modules.items():
            self._install(name, pair[to])
        self._current = to
        self.num_switches += 1
        return True

    def close(self) -> None:
        """Stop applying requests (the installed plan stays)."""
        self._hook.remove()


def _check(plan: str) -> None:
    if plan not in PLANS:
        raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
