"""StateStore against a real Redis with AUTH (requirepass) and TLS, secrets from settings;
a wrong password fails with a message that names the server but never the secret."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from state import StateStore, StateUnavailable
from switchyard import services
from switchyard.devcerts import make_dev_certs
from wiring.settings import Settings

pytestmark = pytest.mark.integration


async def test_auth_and_tls_from_settings(tmp_path: Path) -> None:
    password = secrets.token_hex(16)
    tls = make_dev_certs(tmp_path / "certs")
    rec = services.redis_up(
        port=services.free_port(), home=tmp_path, password=password, tls=tls, name="redis-secure"
    )
    try:
        settings = Settings.from_env(
            {
                "SWITCHYARD_REDIS": rec.address,
                "SWITCHYARD_REDIS_PASSWORD": password,
                "SWITCHYARD_REDIS_TLS_CA": tls.ca,
                "SWITCHYARD_NAMESPACE": "secure",
            }
        )
        assert rec.address.startswith("rediss://") and password not in repr(settings)
        store = await StateStore.connect(**settings.redis_kwargs())
        try:
            assert await store.ping()
            assert await store.reserve_slots("i", 1, ["a", "b"]) == [True, False]
        finally:
            await store.close()
        with pytest.raises(StateUnavailable) as info:
            await StateStore.connect(rec.address, password="wrong-" + password, tls_ca_file=tls.ca)
        assert password not in str(info.value) and "127.0.0.1" in str(info.value)
        with pytest.raises(StateUnavailable):  # no CA: the server's certificate is not trusted
            await StateStore.connect(rec.address, password=password)
        with pytest.raises(ValueError, match="a Redis TLS CA file needs a rediss:// URL"):
            await StateStore.connect(
                rec.address.replace("rediss://", "redis://"), tls_ca_file=tls.ca
            )
    finally:
        services.stop_record(rec, tmp_path)
