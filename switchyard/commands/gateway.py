"""``switchyard gateway`` (the OpenAI-compatible HTTP front door) and ``switchyard api-key``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from wiring.paths import DEFAULT_CLUSTER

if TYPE_CHECKING:
    from gateway.app import GatewayConfig
    from gateway.auth import KeyRing
    from schemas import ClusterConfig
    from wiring.settings import Settings


def register(app: typer.Typer) -> None:
    @app.command("gateway")
    def gateway(
        cluster: Path = typer.Option(
            DEFAULT_CLUSTER, "--cluster", envvar="SWITCHYARD_CLUSTER", help="Cluster config"
        ),
        host: str = typer.Option("127.0.0.1", "--host"),
        port: int = typer.Option(8080, "--port", min=0, max=65535),
        gateway_id: str = typer.Option(
            "gateway", "--id", help="Names its relay topic relay.<id>; one per gateway process"
        ),
        anonymous_tenant: str | None = typer.Option(
            None,
            "--anonymous-tenant",
            help="Serve requests without an API key as this tenant (local use only)",
        ),
        request_timeout_s: float = typer.Option(600.0, "--request-timeout-s", min=1.0),
        partitions: int = typer.Option(4, "--partitions", min=1, help="Of the relay topic"),
        log_level: str = typer.Option("WARNING", "--log-level"),
    ) -> None:
        """Serve /v1/completions, /v1/chat/completions (streaming too) and /v1/models over Kafka."""
        from gateway.app import GatewayConfig
        from gateway.auth import KeyRing
        from schemas import ClusterConfig
        from switchyard.logs import configure_logging
        from wiring.settings import Settings, SettingsError

        configure_logging(log_level)
        try:
            spec = ClusterConfig.from_file(cluster)
            keys = KeyRing.from_cluster(spec, anonymous_tenant)
            settings = Settings.from_env()
            config = GatewayConfig(gateway_id=gateway_id, request_timeout_s=request_timeout_s)
        except (OSError, ValueError, SettingsError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(asyncio.run(_serve(spec, keys, config, settings, host, port, partitions)))

    @app.command("api-key")
    def api_key() -> None:
        """Print a new API key (give it to the client) and its SHA-256 (put it in the cluster
        config under tenants[].api_keys_sha256)."""
        from gateway.auth import new_key

        key, digest = new_key()
        typer.echo(f"key:    {key}\nsha256: {digest}")


async def _serve(
    spec: ClusterConfig,
    keys: KeyRing,
    config: GatewayConfig,
    settings: Settings,
    host: str,
    port: int,
    partitions: int,
) -> int:
    from aiohttp import web

    from gateway.app import start_gateway

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        gw, close = await start_gateway(spec, keys, config, settings, partitions)
    except Exception as exc:  # noqa: BLE001 - Kafka unreachable: one clear line
        typer.echo(f"error: cannot start the gateway: {exc}", err=True)
        return 1
    runner = web.AppRunner(gw.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        typer.echo(
            f"gateway {gw.config.gateway_id} serving the OpenAI API on http://{host}:{port}/v1 "
            f"(relay topic {gw.relay_topic})",
            err=True,
        )
        await stop.wait()
    finally:
        await runner.cleanup()
        await close()
    logging.getLogger(__name__).info("gateway stopped")
    return 0
