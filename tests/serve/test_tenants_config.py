"""Tenants YAML, key lookup and quotas; the serve YAML. No server, no model."""

from __future__ import annotations

import pytest

from mcp2026.serve.config import ServeConfig, load_serve_yaml
from mcp2026.serve.tenants import OPEN_TENANT, RateLimitExceeded, Tenant, TenantRegistry, TokenBucket

TENANTS_YAML = """
tenants:
  - name: acme
    api_keys: [sk-a1, sk-a2]
    weight: 3
    priority: 0
    requests_per_minute: 2
    tokens_per_minute: 1000
  - name: beta
    api_keys: sk-b
    max_concurrency: 1
    cache_salt: beta-salt
"""


def test_tenants_from_yaml(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    registry = TenantRegistry.from_yaml(path)
    acme = registry.authenticate("sk-a2")
    assert acme.name == "acme" and acme.weight == 3 and acme.cache_salt == "acme"
    assert registry.authenticate("sk-b").cache_salt == "beta-salt"
    assert registry.authenticate("sk-nope") is None and registry.authenticate(None) is None
    assert sorted(registry.tenants) == ["acme", "beta"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tenants: []", "non-empty"),
        ("tenants:\n  - name: a\n", "api_keys"),
        ("tenants:\n  - name: a\n    api_keys: [k]\n  - name: b\n    api_keys: [k]\n", "also used"),
        ("tenants:\n  - name: a\n    api_keys: [k]\n    weight: 0\n", "weight"),
        ("tenants:\n  - name: a\n    api_keys: [k]\n    colour: red\n", "colour"),
        ("tenants: [", "cannot read"),
    ],
)
def test_bad_tenants_files(tmp_path, text, match):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        TenantRegistry.from_yaml(path)


def test_open_registry_has_one_unsalted_tenant():
    registry = TenantRegistry()
    assert registry.authenticate(None) is OPEN_TENANT and OPEN_TENANT.cache_salt is None


def test_token_bucket_refills_per_minute():
    bucket = TokenBucket(60.0)
    bucket.updated = 0.0
    assert bucket.wait_s(60, now=0.0) == 0.0
    bucket.take(60)
    assert bucket.wait_s(1, now=0.0) == pytest.approx(1.0)
    assert bucket.wait_s(1, now=1.0) == 0.0
    assert bucket.wait_s(61, now=1.0) == float("inf")


def test_quotas_and_release():
    tenant = Tenant("t", requests_per_minute=2, tokens_per_minute=100, max_concurrency=2)
    registry = TenantRegistry({"k": tenant})
    registry.acquire(tenant, 40)
    registry.acquire(tenant, 40)
    with pytest.raises(RateLimitExceeded, match="max_concurrency"):
        registry.acquire(tenant, 1)
    registry.release(tenant, 40, 10)
    registry.release(tenant, 40, 10)
    with pytest.raises(RateLimitExceeded, match="requests_per_minute") as e:
        registry.acquire(tenant, 1)
    assert 0 < e.value.retry_after_s <= 30
    with pytest.raises(RateLimitExceeded, match="more than"):
        TenantRegistry({"k": tenant}).acquire(tenant, 101)


def test_serve_yaml(tmp_path):
    (tmp_path / "serve.yaml").write_text(
        "port: 9001\ntenants: keys.yaml\ncors_origins: [http://a]\n"
        "kv:\n  num_blocks: 64\nscheduler:\n  max_num_seqs: 8\n"
    )
    serve, engine = load_serve_yaml(tmp_path / "serve.yaml")
    assert serve.port == 9001 and serve.cors_origins == ("http://a",)
    assert serve.tenants_file == str(tmp_path / "keys.yaml")
    assert engine.kv.num_blocks == 64 and engine.scheduler.max_num_seqs == 8
    (tmp_path / "bad.yaml").write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_serve_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="port"):
        ServeConfig(port=70000)
    assert not ServeConfig(host="0.0.0.0").is_loopback and ServeConfig().is_loopback
