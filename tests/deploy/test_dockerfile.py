"""deploy/Dockerfile and Dockerfile.cuda, checked without docker (hadolint-like rules): pinned bases,
multi-stage, a non-root final user, kernels built in the image, a HEALTHCHECK on /healthz, torch as a build
argument, no secrets; and the command they run is one the CLI accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from mcp2026.cli import app

ROOT = Path(__file__).parents[2]
DOCKERFILES = {"cpu": ROOT / "deploy" / "Dockerfile", "cuda": ROOT / "deploy" / "Dockerfile.cuda"}
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_KEY|ACCESS_KEY)", re.I)
PINNED_TAG = re.compile(r"^[\w./-]+:\d+\.\d+(\.\d+)?[\w.-]*(@sha256:[0-9a-f]{64})?$")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def problems(text: str) -> list[str]:
    """What a reviewer would flag; empty when the file keeps every rule."""
    found = []
    ins = instructions(text)
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value.strip('"')
    stages = [rest for word, rest in ins if word == "FROM"]
    if len(stages) < 2:
        found.append("not multi-stage")
    stage_names = {s.split()[-1] for s in stages if " AS " in s.upper()}
    for stage in stages:
        image = stage.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), image)
        if image not in stage_names and not PINNED_TAG.match(image):
            found.append(f"base image not pinned to a release: {image or stage}")
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        found.append("the final stage runs as root")
    checks = [rest for word, rest in final if word == "HEALTHCHECK"]
    if not checks or "/healthz" not in checks[-1]:
        found.append("no HEALTHCHECK on /healthz")
    if not any(w == "RUN" and "python -m mcp2026.kernels.cpu" in r for w, r in ins):
        found.append("kernels not built in the image")
    if "TORCH_SPEC" not in args:
        found.append("no torch build argument")
    for word, rest in ins:
        if word in ("ARG", "ENV") and SECRET_NAME.search(rest.split("=")[0]):
            found.append(f"a secret in the image: {word} {rest}")
        if word == "ADD" and "://" in rest:
            found.append(f"ADD from a URL: {rest}")
        if word == "COPY" and re.search(r"(^|\s)(\.env|id_rsa|\.ssh|\.netrc)\b", rest):
            found.append(f"credentials copied in: {rest}")
    return found


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfile_keeps_the_rules(kind):
    assert problems(DOCKERFILES[kind].read_text()) == []


def test_the_rules_catch_a_bad_dockerfile():
    bad = (
        "FROM python:latest\nENV HF_TOKEN=abc\nADD https://example.com/m.gguf /m.gguf\n"
        'COPY .env /app/.env\nCMD ["mcp2026", "serve"]\n'
    )
    found = " | ".join(problems(bad))
    for rule in (
        "multi-stage",
        "not pinned",
        "runs as root",
        "HEALTHCHECK",
        "kernels",
        "torch",
        "secret",
        "URL",
    ):
        assert rule in found, rule
    assert "credentials" in found


def test_torch_defaults():
    cpu = instructions(DOCKERFILES["cpu"].read_text())
    assert ("ARG", "TORCH_SPEC=torch==2.13.0") in cpu
    assert any(w == "ARG" and r.startswith("TORCH_INDEX_URL=") and r.endswith("/whl/cpu") for w, r in cpu)
    cuda = instructions(DOCKERFILES["cuda"].read_text())
    assert any(w == "ARG" and r.startswith("TORCH_INDEX_URL=") and "/whl/cu" in r for w, r in cuda)


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_image_runs_a_command_the_cli_accepts(kind):
    ins = instructions(DOCKERFILES[kind].read_text())
    (entry,) = [json.loads(r) for w, r in ins if w == "ENTRYPOINT"]  # exec form is JSON
    cmd = [json.loads(r) for w, r in ins if w == "CMD"][-1]
    assert entry == ["mcp2026"] and cmd[0] == "serve"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--port") + 1] == "8000"
    assert ("EXPOSE", "8000") in ins
    help_text = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    for option in (a for a in cmd[1:] if a.startswith("--")):
        assert option in help_text, f"{kind} image passes {option}, which `mcp2026 serve` does not take"


def test_build_inputs_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for kind, path in DOCKERFILES.items():
        for word, rest in instructions(path.read_text()):
            if word == "COPY" and "--from" not in rest:
                for source in rest.split()[:-1]:
                    assert (ROOT / source).exists(), f"{kind}: COPY {source} is not in the repository"
            for extra in re.findall(r"\.\[(\w+)\]", rest):
                assert extra in extras, f"{kind}: installs the {extra!r} extra, which pyproject.toml lacks"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # a local venv would bloat the context and the image
