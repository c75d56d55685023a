"""Shared by every typer app: expected failures print one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

import typer
from rich.console import Console

from mcp2026.errors import MCPError

err = Console(stderr=True, soft_wrap=True, emoji=False)  # "tpot:100:" is text, not an emoji code


def user_errors(fn: Callable[..., Any] | None = None, *, exit_code: int = 2) -> Any:
    """Turn expected failures (bad files, bad values) into a one-line message and exit code 2. Commands whose
    own exit codes use 2 pick another: ``@user_errors(exit_code=3)``."""
    if fn is None:
        return lambda f: user_errors(f, exit_code=exit_code)

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (MCPError, ValueError, FileNotFoundError) as e:
            err.print(f"[bold red]error:[/] {e}", highlight=False)
            raise typer.Exit(exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper
