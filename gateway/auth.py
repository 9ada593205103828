"""API keys → tenants. Keys are never stored: the cluster config lists their SHA-256.

``TenantBudget.api_keys_sha256`` holds the hex digests of the keys that act for a tenant
(``switchyard api-key`` prints a new key and its digest). A request's bearer key is
hashed and looked up; a gateway started with ``anonymous_tenant`` serves requests without
a key as that tenant (for local use), and with no keys configured it refuses to start
unless told so.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from schemas import ClusterConfig


class AuthError(ValueError):
    """The request's credentials are missing or unknown (HTTP 401)."""


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> tuple[str, str]:
    """A fresh API key and its SHA-256 digest (the digest goes in the cluster config)."""
    key = "sy-" + secrets.token_urlsafe(32)
    return key, key_digest(key)


@dataclass(frozen=True)
class KeyRing:
    tenants_by_digest: dict[str, str]
    anonymous_tenant: str | None = None

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig, anonymous_tenant: str | None) -> KeyRing:
        by_digest: dict[str, str] = {}
        for t in cluster.tenants:
            for digest in t.api_keys_sha256:
                if by_digest.setdefault(digest, t.tenant) != t.tenant:
                    raise ValueError(
                        f"API key digest {digest[:12]}… is listed for tenants "
                        f"{by_digest[digest]!r} and {t.tenant!r}"
                    )
        known = {t.tenant for t in cluster.tenants}
        if anonymous_tenant is not None and known and anonymous_tenant not in known:
            raise ValueError(
                f"--anonymous-tenant {anonymous_tenant!r} is not a tenant of the cluster config "
                f"(tenants: {sorted(known)}); the router would refuse its queries"
            )
        if not by_digest and anonymous_tenant is None:
            raise ValueError(
                "no API keys in the cluster config (tenants[].api_keys_sha256; "
                "`switchyard api-key` makes one) and no --anonymous-tenant: "
                "nobody could use the gateway"
            )
        return cls(by_digest, anonymous_tenant)

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header; ``AuthError`` otherwise."""
        if not authorization:
            if self.anonymous_tenant is not None:
                return self.anonymous_tenant
            raise AuthError("missing API key: send Authorization: Bearer <key>")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("the Authorization header must be 'Bearer <key>'")
        digest = key_digest(key.strip())
        for known, tenant in self.tenants_by_digest.items():
            if hmac.compare_digest(known, digest):
                return tenant
        if not self.tenants_by_digest and self.anonymous_tenant is not None:
            return self.anonymous_tenant  # an open gateway ignores whatever key a client sends
        raise AuthError("incorrect API key provided")
