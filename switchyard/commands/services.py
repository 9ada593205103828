"""``switchyard services up|down|status|env``: local Kafka and Redis without Docker."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def register(app: typer.Typer) -> None:
    svc = typer.Typer(
        help="Local Kafka (Maven Central jars, KRaft) and Redis on loopback.", no_args_is_help=True
    )
    app.add_typer(svc, name="services")

    @svc.command("up")
    def up(
        kafka: bool = typer.Option(True, help="Start the Kafka broker"),
        redis: bool = typer.Option(True, help="Start redis-server"),
        kafka_port: int = typer.Option(
            0, envvar="SWITCHYARD_KAFKA_PORT", help="0: 19092 or any free port"
        ),
        redis_port: int = typer.Option(
            0, envvar="SWITCHYARD_REDIS_PORT", help="0: 16379 or any free port"
        ),
        redis_appendfsync: str = typer.Option(
            "always",
            envvar="SWITCHYARD_REDIS_APPENDFSYNC",
            help="Redis AOF fsync policy: always (default: nothing acknowledged is lost, even "
            "on a power loss), everysec (up to ~1 s lost on a host crash), or none (no "
            "persistence: the budget ledger is then rebuilt from Kafka after a restart)",
        ),
        kafka_brokers: int = typer.Option(
            0, help="N >= 1: a local KRaft cluster of N broker+controller nodes instead of one"
        ),
        redis_cluster: int = typer.Option(
            0, help="N >= 3: a local Redis Cluster of N primaries instead of one redis-server"
        ),
        redis_replicas: int = typer.Option(
            0, help="With --redis-cluster: replicas per primary (1 for failover)"
        ),
        vllm: int = typer.Option(
            0,
            help="N >= 1: also start N real vLLM servers (CPU build, random weights), one per "
            "local instance of --vllm-cluster, with that model's engine settings",
        ),
        vllm_cluster: Path = typer.Option(
            Path("configs/clusters/real-vllm-cpu.yaml"),
            help="Cluster config whose instances the vLLM servers serve (ports from endpoints)",
        ),
    ) -> None:
        """Start the services (idempotent) and print their addresses as env lines.

        Redis keeps an append-only file in its data directory (kept by `down`), so a restart
        finds the budget ledger as it was.
        """
        from switchyard import clusters, services

        try:
            if redis and redis_cluster:
                clusters.redis_cluster_up(redis_cluster, replicas=redis_replicas)
                redis = False
            if kafka and kafka_brokers:
                clusters.kafka_cluster_up(kafka_brokers)
                kafka = False
            if redis:
                services.redis_up(
                    port=redis_port or None,
                    appendfsync=None if redis_appendfsync == "none" else redis_appendfsync,
                )
            if kafka:
                services.kafka_up(port=kafka_port or None)
            if vllm:
                from schemas.cluster import ClusterConfig
                from switchyard import vllm_servers

                cluster = ClusterConfig.from_file(vllm_cluster)
                for rec in vllm_servers.vllm_up(cluster, count=vllm):
                    typer.echo(
                        f"# vLLM {rec.extra['instance']} ({rec.extra['model']}) at {rec.address}, "
                        f"pid {rec.pid}, ready in {rec.extra.get('ready_s', '?')} s"
                    )
        except (services.ServiceError, RuntimeError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        for line in [*services.env_lines(), *clusters.env_lines()]:
            typer.echo(line)

    @svc.command("install-vllm")
    def install_vllm() -> None:
        """Build (once) the real vLLM engine's own venv under ~/.cache/switchyard; print it."""
        from switchyard import vllm_env

        try:
            env = vllm_env.install(quiet=False)
        except vllm_env.VllmInstallError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        how = f"installed in {env.install_s:.0f} s" if env.install_s else "already installed"
        typer.echo(f"vllm {env.version} at {env.root} ({how}, {env.size_bytes / 2**30:.2f} GiB)")

    @svc.command("make-vllm-model")
    def make_vllm_model() -> None:
        """Make (once) the random-weight Qwen3 model directory the vLLM servers serve."""
        from switchyard import vllm_model

        shape = vllm_model.ModelShape()
        path = vllm_model.make_model_dir(shape)
        typer.echo(f"{path} ({shape.parameters() / 1e6:.1f}M parameters)")

    @svc.command("down")
    def down(
        purge: bool = typer.Option(
            False, "--purge", help="Also delete Redis's data (its append-only file)"
        ),
    ) -> None:
        """Stop only the processes `up` started (recorded pids); Redis's data is kept."""
        from switchyard import clusters, services

        stopped = clusters.down()
        stopped += services.down(purge=purge)
        typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))

    @svc.command("status")
    def status(as_json: bool = typer.Option(False, "--json")) -> None:
        """Each service, its address, version and pid."""
        from switchyard import clusters, services

        rows = services.status()
        roles = {r["service"]: r["role"] for r in clusters.status_rows()}
        for r in rows:
            if r["service"] in roles:
                r["role"] = roles[r["service"]]
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        table = Table("service", "address", "version", "pid", "running", "role")
        for r in rows:
            table.add_row(
                r["service"],
                r["address"],
                r["version"],
                str(r["pid"]),
                "yes" if r["running"] else "NO",
                r.get("role", ""),
            )
        if not rows:
            typer.echo("no services started by switchyard")
            return
        Console().print(table)

    @svc.command("env")
    def env() -> None:
        """SWITCHYARD_KAFKA / SWITCHYARD_REDIS lines for the running services."""
        from switchyard import clusters, services

        for line in [*services.env_lines(), *clusters.env_lines()]:
            typer.echo(line)
