"""The ``mcp2026`` command line: bad input exits 2 with one "error:" line (no traceback); info, generate, help."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from mcp2026.cli import app
from mcp2026.cli_lazy import LazyCommand


def run_cli(*args: str, prog: tuple[str, ...] = ("-m", "mcp2026.cli")) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *prog, *map(str, args)], capture_output=True, text=True, timeout=300
    )


def assert_user_error(returncode: int, stderr: str, *phrases: str) -> None:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert all(p in lines[0] for p in phrases), stderr


def test_missing_model_path(tmp_path):
    result = run_cli("generate", "hi", "--model", tmp_path / "no_such_model")
    assert_user_error(result.returncode, result.stderr, "no_such_model", "no such file or directory")
    assert result.stdout == ""


def test_corrupted_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    result = run_cli("info", path)
    assert_user_error(result.returncode, result.stderr, "broken.gguf", "GGUF")


def test_unknown_architecture(tmp_path):
    folder = tmp_path / "neox"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    result = run_cli("generate", "hi", "--model", folder)
    assert_user_error(
        result.returncode, result.stderr, "GPTNeoXForCausalLM", "supported: ", "LlamaForCausalLM"
    )


@pytest.mark.parametrize(
    ("option", "phrase"),
    [
        (["--temperature", "-1"], "temperature must be in [0.0, 100.0]"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--top-p", "0"], "top_p must be in"),
    ],
)
def test_invalid_sampling_values(option, phrase):
    result = CliRunner().invoke(app, ["generate", "hi", *option])
    assert_user_error(result.exit_code, result.stderr, phrase)
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_invalid_values_in_a_subprocess():
    result = run_cli("generate", "hi", "--max-tokens", "0")
    assert_user_error(result.returncode, result.stderr, "max_tokens")


def test_info_on_tiny_hf_dir(tiny_llama_dir: Path):
    result = CliRunner().invoke(app, ["info", str(tiny_llama_dir)])
    assert result.exit_code == 0, result.output
    for row in ("architecture", "LlamaForCausalLM", "parameters", "layers / hidden / ffn", "2 / 64 / 128"):
        assert row in result.stdout
    assert "safetensors" in result.stdout and "float32 x" in result.stdout


def test_compile_without_config_is_a_user_error(tmp_path):
    result = CliRunner().invoke(app, ["compile", str(tmp_path / "no_model")])
    assert_user_error(result.exit_code, result.stderr, "--config", "--out")


def test_mcp_compile_help():
    script = Path(sys.executable).with_name("mcp-compile")
    if not script.exists():
        pytest.skip("the mcp-compile console script is not installed next to this interpreter")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout and "--config" in result.stdout and "--out" in result.stdout


def test_help_lists_commands():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    assert all(cmd in result.stdout for cmd in ("generate", "info", "compile"))


@pytest.mark.slow
def test_generate_streams_with_default_model():
    result = run_cli("generate", "Name a color.", "--max-tokens", "8", "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip()
    assert "tokens, finish=" in result.stderr


def test_info_says_which_path_a_gguf_runs(tmp_path: Path):
    from mcp2026.kernels import cpu

    from gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_K", v_type="Q6_K")

    def table_text(*args: str) -> str:  # the rows' words, whatever the table wrapped
        result = CliRunner().invoke(app, ["info", str(path), *args])
        assert result.exit_code == 0, result.output
        return " ".join(result.stdout.replace("│", " ").split())

    if cpu.load() is not None:
        assert "native: Q4_K, Q6_K as stored, block_gemm" in table_text()
    floats = table_text("--dtype", "fp32")
    assert "float float32 (dtype=fp32 asks for float weights)" in floats and "weights in memory" in floats


def _lazy_commands(group, path=()):
    """(command path, placeholder, loaded command) for every lazily listed command, sub-groups' included."""
    for name, command in group.commands.items():
        if isinstance(command, LazyCommand):
            loaded = command.load()
            yield (*path, name), command, loaded
            if hasattr(loaded, "commands"):
                yield from _lazy_commands(loaded, (*path, name))


def test_listed_help_is_the_commands_own():
    found = list(_lazy_commands(typer.main.get_command(app)))
    names = {" ".join(path) for path, _, _ in found}
    assert {"generate", "serve", "bench", "bench latency", "bench serve", "doctor", "canary", "kv"} <= names
    for path, placeholder, loaded in found:
        own = " ".join(inspect.cleandoc(loaded.help or "").split())
        assert own.startswith(" ".join(placeholder.help.split())), f"{' '.join(path)}: listed help differs"
        assert loaded.name == path[-1] and not isinstance(loaded, LazyCommand)


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"]])
def test_listing_commands_loads_no_torch(args):
    code = (
        "import sys\nfrom mcp2026.cli import app\n"
        f"try:\n    app({args!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'mcp2026.pipeline', 'mcp2026.bench.latency') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "latency" in result.stdout and result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_a_listed_command_runs_from_its_own_module(tmp_path):
    result = run_cli("kv", "calibrate", "--out", tmp_path / "weights.txt", "--no-progress")
    assert_user_error(result.returncode, result.stderr, "--out must name a .json file")
