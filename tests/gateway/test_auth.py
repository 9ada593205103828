"""API keys → tenants (``gateway.auth``): digests only, constant-time lookups, clear refusals."""

from __future__ import annotations

import pytest

from gateway.auth import AuthError, KeyRing, key_digest, new_key
from schemas import ClusterConfig


def cluster(tenants: list[dict[str, object]]) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [{"name": "m", "input_usd_per_token": 0, "output_usd_per_token": 0}],
            "instances": [{"id": "i", "model": "m"}],
            "tenants": tenants,
        }
    )


def test_keys_map_to_their_tenant_and_nothing_else() -> None:
    key, digest = new_key()
    assert digest == key_digest(key) and key not in digest and len(digest) == 64
    ring = KeyRing.from_cluster(cluster([{"tenant": "acme", "budget_usd": 1, "api_keys_sha256": [digest]}]), None)
    assert ring.tenant_for(f"Bearer {key}") == "acme"
    for bad in (None, "", "Bearer", f"Basic {key}", "Bearer sy-other"):
        with pytest.raises(AuthError):
            ring.tenant_for(bad)


def test_refusals_at_start_name_the_problem() -> None:
    with pytest.raises(ValueError, match="no API keys"):
        KeyRing.from_cluster(cluster([{"tenant": "acme", "budget_usd": 1}]), None)
    with pytest.raises(ValueError, match="not a tenant"):
        KeyRing.from_cluster(cluster([{"tenant": "acme", "budget_usd": 1}]), "default")
    with pytest.raises(ValueError, match="SHA-256"):
        cluster([{"tenant": "acme", "budget_usd": 1, "api_keys_sha256": ["not-a-digest"]}])
    d = key_digest("k")
    with pytest.raises(ValueError, match="listed for tenants"):
        KeyRing.from_cluster(
            cluster([{"tenant": "a", "budget_usd": 1, "api_keys_sha256": [d]},
                     {"tenant": "b", "budget_usd": 1, "api_keys_sha256": [d]}]), None)  # fmt: skip
    open_ring = KeyRing.from_cluster(cluster([]), "default")
    assert open_ring.tenant_for(None) == "default" == open_ring.tenant_for("Bearer anything")
