"""Tenants: API keys (from a YAML file) map to a tenant with a weight, a priority, rate limits and a
concurrency cap. Without a keys file there is one open tenant, "default".

```yaml
tenants:
  - name: acme
    api_keys: [sk-acme-1, sk-acme-2]
    weight: 3            # share of processed tokens under contention (fair scheduling)
    priority: 0          # lower is more urgent (engine "priority" policy, breaker exemption)
    requests_per_minute: 600
    tokens_per_minute: 200000
    max_concurrency: 32
    cache_salt: acme     # prefix-cache isolation key; defaults to the tenant name
```
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    priority: int = 0
    requests_per_minute: float | None = None  # None = unlimited
    tokens_per_minute: float | None = None  # prompt + generated tokens
    max_concurrency: int | None = None
    cache_salt: str | None = None  # None: no salt (the single open tenant shares its cache)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a non-empty name")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name}: weight must be > 0, got {self.weight}")
        for key in ("requests_per_minute", "tokens_per_minute", "max_concurrency"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"tenant {self.name}: {key} must be > 0 (or absent), got {value}")


OPEN_TENANT = Tenant("default")


class RateLimitExceeded(Exception):
    """Over a tenant's quota; ``retry_after_s`` says when the request would fit."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class TokenBucket:
    """``capacity`` units, refilled at ``capacity`` per minute."""

    capacity: float
    level: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """0 if ``amount`` can be taken now, else seconds until it could (inf if it never fits)."""
        self._refill(now)
        if amount <= self.level:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) * 60.0 / self.capacity

    def take(self, amount: float) -> None:
        self.level -= amount  # may go below 0 when charging actual usage after the fact


@dataclass
class _Usage:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    num_in_flight: int = 0


class TenantRegistry:
    """Authenticates keys and enforces per-tenant quotas. Thread-safe."""

    def __init__(self, tenants_by_key: dict[str, Tenant] | None = None) -> None:
        self.is_open = tenants_by_key is None
        # Keys are held as digests: lookups compare digests in constant time.
        self._by_digest = {_digest(k): t for k, t in (tenants_by_key or {}).items()}
        tenants = {t.name: t for t in self._by_digest.values()} or {OPEN_TENANT.name: OPEN_TENANT}
        self.tenants = tenants
        self._usage = {
            name: _Usage(
                TokenBucket(t.requests_per_minute) if t.requests_per_minute else None,
                TokenBucket(t.tokens_per_minute) if t.tokens_per_minute else None,
            )
            for name, t in tenants.items()
        }
        self._lock = threading.Lock()

    @classmethod
    def from_yaml(cls, path: str | Path) -> TenantRegistry:
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{path}: cannot read the tenants file ({e})") from None
        entries = raw.get("tenants") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{path}: expected a non-empty `tenants:` list")
        by_key: dict[str, Tenant] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            tenant, keys = _parse_tenant(entry, f"{path}: tenants[{i}]")
            if tenant.name in names:
                raise ValueError(f"{path}: tenant name {tenant.name!r} appears twice")
            names.add(tenant.name)
            for key in keys:
                if key in by_key:
                    raise ValueError(f"{path}: an API key of {tenant.name!r} is also used by another tenant")
                by_key[key] = tenant
        return cls(by_key)

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant of this key; the open tenant when no keys are configured; None for a bad key."""
        if self.is_open:
            return OPEN_TENANT
        if not api_key:
            return None
        digest = _digest(api_key)
        found = None
        for known, tenant in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    def acquire(self, tenant: Tenant, num_tokens: int) -> None:
        """Admit one request estimated at ``num_tokens`` or raise RateLimitExceeded. Pair with ``release``."""
        now = time.monotonic()
        with self._lock:
            usage = self._usage[tenant.name]
            if tenant.max_concurrency is not None and usage.num_in_flight >= tenant.max_concurrency:
                raise RateLimitExceeded(
                    f"tenant {tenant.name} has {usage.num_in_flight} requests in flight "
                    f"(max_concurrency {tenant.max_concurrency})",
                    1.0,
                )
            wait_requests = usage.requests.wait_s(1, now) if usage.requests else 0.0
            wait_tokens = usage.tokens.wait_s(num_tokens, now) if usage.tokens else 0.0
            if wait_tokens == math.inf:
                raise RateLimitExceeded(
                    f"this request needs {num_tokens} tokens, more than tenant {tenant.name}'s "
                    f"tokens_per_minute ({tenant.tokens_per_minute:g}); lower max_tokens or the prompt",
                    60.0,
                )
            if wait_requests or wait_tokens:
                limit = "requests_per_minute" if wait_requests >= wait_tokens else "tokens_per_minute"
                raise RateLimitExceeded(
                    f"tenant {tenant.name} is over its {limit} limit", max(wait_requests, wait_tokens)
                )
            if usage.requests:
                usage.requests.take(1)
            if usage.tokens:
                usage.tokens.take(num_tokens)
            usage.num_in_flight += 1

    def release(self, tenant: Tenant, estimated_tokens: int, used_tokens: int) -> None:
        """End a request admitted by ``acquire``; the token bucket is corrected to what it really used."""
        with self._lock:
            usage = self._usage[tenant.name]
            usage.num_in_flight -= 1
            if usage.tokens:
                usage.tokens.take(used_tokens - estimated_tokens)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _parse_tenant(entry: Any, where: str) -> tuple[Tenant, list[str]]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping with name and api_keys")
    entry = dict(entry)
    keys = entry.pop("api_keys", None)
    if isinstance(keys, str):
        keys = [keys]
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"{where}: api_keys must be a non-empty list of strings")
    entry.setdefault("cache_salt", entry.get("name"))
    try:
        return Tenant(**entry), keys
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
