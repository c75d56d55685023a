"""``mcp2026 bench plugin NAME_OR_SPEC``: run a benchmark plugin (bench/plugins.py) and record its run.
Listed on the bench app by bench/cli.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import finish_run, out
from mcp2026.bench.plugins import PluginContext, available_plugins, load_plugin, run_plugin
from mcp2026.bench.report import shell_join
from mcp2026.cli_errors import err, user_errors


def parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param takes KEY=VALUE, got {item!r}")
        params[key.strip()] = value
    return params


@user_errors
def plugin(
    name: Annotated[
        str | None,
        typer.Argument(help="installed plugin name, module:Class or path/to/file.py:Class"),
    ] = None,
    plugin_option: Annotated[
        str | None, typer.Option("--plugin", help="the same, as an option: --plugin module:Class")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="HF folder, .gguf or artifact")] = None,
    dtype: Annotated[str, typer.Option(help="auto | fp32 | bf16")] = "auto",
    seed: Annotated[int, typer.Option(help="seed handed to the plugin")] = 0,
    param: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the plugin, repeatable")] = None,
    list_plugins: Annotated[bool, typer.Option("--list", help="list installed plugins and exit")] = False,
    out_dir: Annotated[Path | None, typer.Option("--out", help="folder for the run (default: runs/)")] = None,
) -> None:
    """Run a custom benchmark plugin (init, then run returning named numbers) and record it like the others."""
    if list_plugins:
        found = available_plugins()
        for plugin_name, target in sorted(found.items()):
            out.print(f"{plugin_name}\t{target}", markup=False, highlight=False)
        if not found:
            err.print("no plugins installed (entry point group mcp2026.bench_plugins)")
        return
    if name is not None and plugin_option is not None and name != plugin_option:
        raise ValueError(f"two plugins given ({name!r} and --plugin {plugin_option!r}); give one")
    name = name or plugin_option
    if name is None:
        raise ValueError(
            "give a plugin: an installed name, module:Class or path/to/file.py:Class (or --list)"
        )
    params = parse_params(param or [])
    plugin_name, instance = load_plugin(name)
    ctx = PluginContext(model=model, dtype=dtype, seed=seed, out_dir=out_dir, params=params)
    args = [name, *(["--model", model] if model else []), "--dtype", dtype, "--seed", str(seed)]
    args += [a for key, value in params.items() for a in ("--param", f"{key}={value}")]
    run = run_plugin(plugin_name, instance, ctx, command=shell_join(["mcp2026", "bench", "plugin", *args]))
    finish_run(run, out_dir, False, "plugin")
