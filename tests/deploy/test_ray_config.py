"""deploy/ray/: the Ray Serve config validates against Ray's own schema, names the deployments build_app
creates, and its serve YAML and autoscaling policy load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mcp2026.serve.config import load_serve_yaml
from mcp2026.serve.ray_autoscaling import EngineLoadPolicy

ROOT = Path(__file__).resolve().parents[2]
RAY_CONFIG = ROOT / "deploy" / "ray" / "ray-serve.yaml"


def test_ray_serve_config_matches_the_app():
    schema = pytest.importorskip("ray.serve.schema", reason="needs Ray Serve (pip install 'mcp2026[ray]')")
    raw = yaml.safe_load(RAY_CONFIG.read_text())
    app = schema.ServeDeploySchema.model_validate(raw).applications[0]
    assert app.import_path == "mcp2026.serve.ray_ingress:build_app"
    load_serve_yaml(ROOT / app.args["config"])  # relative to the repository root, where `serve run` starts
    names = {d.name for d in app.deployments}
    assert names == {"router", *(f"engine-{i}" for i in range(app.args["replicas"]))}
    for deployment in app.deployments:
        if deployment.name != "router":
            policy = deployment.autoscaling_config["policy"]
            assert policy["policy_function"] == "mcp2026.serve.ray_autoscaling:EngineLoadPolicy"
            EngineLoadPolicy(**policy["policy_kwargs"])
