"""Sub-commands loaded when they run: the parent lists each by name and one-line help, and imports the module
that defines it (with torch, the engine, a benchmark's peers) only when that sub-command is invoked, so
``mcp2026 --help`` and the start of every command stay fast. The module imports what it needs at its top."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


class LazyCommand(TyperCommand):
    """A placeholder in its group's listing. ``target`` is ``"module:attribute"``: a typer app (one command or
    a group) or a command function; ``help`` is the line the parent's ``--help`` shows without importing it."""

    def __init__(self, name: str, target: str, help: str) -> None:
        super().__init__(name, help=help, short_help=help)
        self.target = target

    def load(self) -> Any:
        module_name, _, attribute = self.target.partition(":")
        loaded = getattr(importlib.import_module(module_name), attribute)
        if isinstance(loaded, typer.Typer):
            app = loaded
        else:
            app = typer.Typer(add_completion=False)
            app.command(self.name)(loaded)
        command = typer.main.get_command(app)
        command.name = self.name
        return command

    def invoke(self, ctx: Any) -> Any:
        raise RuntimeError(f"{self.name} was not loaded: its group must be a lazy_group()")


def lazy_group(*commands: LazyCommand) -> type[TyperGroup]:
    """A group class for ``typer.Typer(cls=...)`` that lists ``commands`` beside the app's own and loads one
    when the command line names it."""
    table = {c.name: c for c in commands}

    class LazyGroup(TyperGroup):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            for name, placeholder in table.items():
                self.commands.setdefault(name, placeholder)

        def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
            name, command, rest = super().resolve_command(ctx, args)
            if isinstance(command, LazyCommand):
                command = command.load()
            return name, command, rest

    return LazyGroup
