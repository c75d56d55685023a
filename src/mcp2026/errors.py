"""Errors that carry a user-facing, one-line explanation (the CLI prints them without a traceback)."""


class MCPError(Exception):
    """Base class: the message says what is wrong and what to do."""


class ModelLoadError(MCPError):
    """A model path, file or config that cannot be loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture has no implementation here."""


class NotSupportedYetError(MCPError):
    """A configuration value that is accepted by the API but not implemented yet."""


class ExportError(MCPError):
    """A model, plan or output path that cannot be written in the asked export format."""
