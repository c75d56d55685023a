"""``mcp2026 doctor``: JSON document and exit codes (0 with warnings, 1 on a FAIL, 2 on bad options)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mcp2026.cli import app
from mcp2026.doctor.checks import SECTIONS

runner = CliRunner()


def _run(*args: str):
    result = runner.invoke(app, ["doctor", *args])
    return result, result.stdout


def _serve_yaml(tmp_path, model) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(f"model: {model}\nport: 0\nkv:\n  block_size: 32\n")
    return str(path)


def _check_document(doc: dict, exit_code: int) -> dict:
    assert set(doc) == {"schema_version", "results", "summary"}
    assert {r["section"] for r in doc["results"]} == set(SECTIONS)
    for r in doc["results"]:
        assert r["status"] in ("PASS", "WARN", "FAIL", "SKIP")
        assert bool(r["fix"]) == (r["status"] in ("WARN", "FAIL")), r
    failed = sum(r["status"] == "FAIL" for r in doc["results"])
    assert doc["summary"]["fail"] == failed and doc["summary"]["ok"] == (failed == 0)
    assert exit_code == (1 if failed else 0)
    return {(r["section"], r["name"]): r for r in doc["results"]}


def test_quick_json_on_a_tiny_model(tmp_path, tiny_llama_dir):
    result, out = _run("--config", _serve_yaml(tmp_path, tiny_llama_dir), "--quick", "--json")
    rows = _check_document(json.loads(out), result.exit_code)
    assert result.exit_code == 0, out
    assert rows[("model", "files")]["status"] == "PASS"
    assert rows[("kv", "block size")]["details"]["block_size"] == 32
    assert rows[("serving", "port 0")]["status"] == "PASS"


def test_corrupted_model_exits_1_with_the_table(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    result, out = _run("--config", _serve_yaml(tmp_path, bad), "--quick")
    assert result.exit_code == 1
    # the table wraps long reasons at the terminal width, and the reason holds the tmp path (its length
    # varies between runs): look for the words, not the phrase
    words = " ".join(out.replace("│", " ").split())
    assert "FAIL" in out and "bad" in words and "magic" in words and "failed" in out.splitlines()[-1]


def test_bad_options_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "serve.yaml"
    bad.write_text("prot: 80\n")
    result = runner.invoke(app, ["doctor", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown keys ['prot']" in result.output
    result = runner.invoke(app, ["doctor", "--ca-bundle", str(tmp_path / "none.pem")])
    assert result.exit_code == 2 and "no such file" in result.output


@pytest.mark.slow
def test_quick_json_on_the_default_model():
    result, out = _run("--quick", "--json")
    rows = _check_document(json.loads(out), result.exit_code)
    for key in (
        ("model", "files"),
        ("model", "architecture"),
        ("kv", "cache layout"),
        ("memory", "memory fit"),
    ):
        assert rows[key]["status"] == "PASS", rows[key]
    assert rows[("model", "files")]["details"]["format"] == "gguf"
