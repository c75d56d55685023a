"""What the checks look at: the serve and engine configs, the model, and the command's options.

The model is inspected once and shared: checks that need it (memory, KV layout, weights) turn a model
that cannot be read into a SKIP pointing at the model/file check, which reports the problem itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from mcp2026.config import EngineConfig, ModelConfig, QuantConfig
from mcp2026.doctor.model_files import ModelFiles, inspect_model, model_config
from mcp2026.doctor.result import CheckResult, skipped
from mcp2026.errors import MCPError
from mcp2026.loading.loader import default_model_path
from mcp2026.pipeline import resolve_dtype
from mcp2026.serve.config import ServeConfig, load_quant_config, load_serve_yaml


@dataclass(frozen=True)
class DoctorContext:
    serve: ServeConfig = field(default_factory=ServeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: Path | None = None  # None: the serve config's model, else the embedded default model
    url: str | None = None  # a running server to probe
    ca_bundle: Path | None = None  # PEM CA certificates the TLS chain must verify against
    quick: bool = False  # skip measurements that are not cached yet
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where `serve` runs

    @classmethod
    def from_options(
        cls,
        config: Path | None = None,
        model: Path | None = None,
        url: str | None = None,
        ca_bundle: Path | None = None,
        quick: bool = False,
    ) -> DoctorContext:
        """A bad serve YAML raises ValueError (the command prints it and exits 2)."""
        serve, engine = load_serve_yaml(config) if config else (ServeConfig(), EngineConfig())
        model = model or (Path(serve.model) if serve.model else None)
        return cls(serve, engine, model, url, ca_bundle, quick)

    # ---- the model, inspected once -----------------------------------------------------------------
    @cached_property
    def _model_files(self) -> ModelFiles | MCPError:
        try:
            return inspect_model(self.model.expanduser() if self.model else default_model_path())
        except MCPError as e:
            return e

    @cached_property
    def _model_config(self) -> ModelConfig | MCPError:
        files = self._model_files
        if isinstance(files, MCPError):
            return files
        try:
            return model_config(files)
        except MCPError as e:
            return e

    def model_files(self) -> ModelFiles:
        """The inspected files; raises the MCPError that says what is wrong with them."""
        if isinstance(self._model_files, MCPError):
            raise self._model_files
        return self._model_files

    def model_config(self) -> ModelConfig:
        if isinstance(self._model_config, MCPError):
            raise self._model_config
        return self._model_config

    def needs_model(self, name: str) -> CheckResult | None:
        """A SKIP when the model cannot be read or has no usable config, else None."""
        if isinstance(self._model_config, MCPError):
            return skipped(
                name, "needs a readable model with a supported architecture (see the model checks)"
            )
        return None

    # ---- the quantization config -------------------------------------------------------------------
    @cached_property
    def quant_config(self) -> QuantConfig | None:
        """The serve config's quant YAML, or None; raises ValueError/FileNotFoundError when unreadable."""
        return load_quant_config(self.serve.quant) if self.serve.quant else None

    def uniform_quant(self) -> QuantConfig | None:
        """The quant config when it quantizes every layer to one format (no DQG: no pre-compensation,
        no per-layer choice), else None; an unreadable YAML is None here (the quant config check fails)."""
        try:
            quant = self.quant_config
        except (ValueError, OSError, MCPError):
            return None
        if quant is None or quant.enable_dqg or not quant.quantizes_weights:
            return None
        return quant

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the server would load the weights in (``Pipeline``'s rule)."""

        try:
            quant = self.quant_config
        except (ValueError, OSError, MCPError):
            quant = None  # reported by the quant config check
        return resolve_dtype(self.serve.dtype, quant)
