"""``switchyard router``: run the Faust routing app (streams/) until SIGTERM or Ctrl-C.

Several routers with the same ``--app-id`` share the ``queries`` partitions (one Kafka
consumer group) and all their state through Redis.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import typer

DEFAULT_POLICY = "batch-ilp-sfs"


def register(app: typer.Typer) -> None:
    @app.command("router")
    def router(
        cluster: Path = typer.Option(
            ..., "--cluster", help="Cluster YAML/JSON (models, instances, tenants)"
        ),
        policy: str = typer.Option(
            DEFAULT_POLICY, "--policy", help="Policy name in routing.policies, or module:factory"
        ),
        predictor: Path | None = typer.Option(
            None, "--predictor", help="Quality predictor artefact"
        ),
        window_ms: float = typer.Option(50.0, "--window-ms", min=1.0, help="Routing window"),
        max_batch: int = typer.Option(
            1000, "--max-batch", min=1, help="Queries per window at most"
        ),
        partitions: int = typer.Option(
            4, "--partitions", min=1, help="Partitions of topics it creates"
        ),
        stale_after_s: float = typer.Option(
            2.0, "--stale-after-s", help="Snapshot age that means stale"
        ),
        budget_hold_s: float = typer.Option(
            2.0, "--budget-hold-s", help="Give up on a query deferred for budget after"
        ),
        max_hold_s: float = typer.Option(
            60.0, "--max-hold-s", help="Give up on a query waiting for capacity after"
        ),
        pacing: float = typer.Option(
            0.0,
            "--pacing",
            help="Window budget = remaining × min(1, pacing × window / period left); 0: off",
        ),
        metrics_port: int = typer.Option(
            0, "--metrics-port", help="Prometheus /metrics port (0: none)"
        ),
        app_id: str = typer.Option("switchyard-router", "--app-id", help="Kafka consumer group"),
        commit_interval_s: float = typer.Option(
            0.5, "--commit-interval-s", help="Offset commit period"
        ),
        offset_reset: str = typer.Option(
            "earliest", "--from", help="A new consumer group starts at: earliest | latest"
        ),
        rescue_grace_s: float = typer.Option(
            6.0,
            "--rescue-grace-s",
            help="Re-route the queued queries of an instance silent this long after its "
            "heartbeat expired (about two heartbeat TTLs); 0: never",
        ),
        rescue_lease_s: float = typer.Option(
            15.0, "--rescue-lease-s", help="A re-routing claim not renewed this long lapses"
        ),
        loglevel: str = typer.Option("WARNING", "--loglevel"),
    ) -> None:
        """Route queries from `queries` to `route.<instance>` in windows."""
        from schemas import ClusterConfig
        from streams.app import create_app, run
        from streams.metrics import RouterMetrics
        from streams.policy import PolicyError, load_router
        from streams.rescue import RescueConfig
        from streams.service import RouterConfig
        from wiring import kafka_admin, topics
        from wiring.settings import Settings, SettingsError

        logging.basicConfig(
            level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        try:
            settings = Settings.from_env()
            spec = ClusterConfig.from_file(cluster)
            chosen = load_router(policy, spec, predictor)
            rescue = (
                RescueConfig(grace_s=rescue_grace_s, lease_s=rescue_lease_s)
                if rescue_grace_s > 0
                else None
            )
        except (SettingsError, PolicyError, OSError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        names = [topics.QUERIES, topics.RESULTS, topics.DEAD_LETTERS, topics.DECISIONS]
        names += [topics.route(i.id) for i in spec.instances]
        try:
            asyncio.run(
                kafka_admin.ensure_topics(
                    settings.kafka_kwargs(),
                    names,
                    partitions=partitions,
                    **settings.topic_kwargs(),
                )
            )
        except Exception as exc:
            typer.echo(f"error: cannot create topics on Kafka at {settings.kafka}: {exc}", err=True)
            raise typer.Exit(1) from None
        metrics = RouterMetrics()
        if metrics_port:
            metrics.serve(metrics_port)
        config = RouterConfig(
            window_s=window_ms / 1000.0,
            max_batch=max_batch,
            stale_after_s=stale_after_s,
            max_hold_s=max_hold_s,
            budget_hold_s=budget_hold_s,
            pacing_factor=pacing,
        )
        runtime = create_app(
            spec,
            chosen,
            settings,
            config,
            app_id=app_id,
            partitions=partitions,
            metrics=metrics,
            commit_interval_s=commit_interval_s,
            offset_reset=offset_reset,
            rescue=rescue,
        )
        typer.echo(
            f"router {app_id}: policy {getattr(chosen, 'name', policy)}, window {window_ms:g} ms, "
            f"max batch {max_batch}, {len(spec.instances)} instances, Kafka {settings.kafka}, "
            f"Redis {settings.redis_display()}",
            err=True,
        )
        run(runtime, loglevel=loglevel)
