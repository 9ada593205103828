"""``switchyard router``: run the Faust routing app (streams/) until SIGTERM or Ctrl-C.

Several routers with the same ``--app-id`` share the ``queries`` partitions (one Kafka
consumer group) and all their state through Redis.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from routing.window_defaults import (
    BUDGET_HOLD_S,
    MAX_BATCH,
    MAX_HOLD_S,
    SHED_AFTER_SLO,
    SHED_BACKLOG,
)
from wiring.paths import DEFAULT_CLUSTER

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_POLICY = "batch-ilp-sfs"
# ``routing.policies.ROUTERS`` by name (importing it costs seconds; a test keeps them equal)
POLICY_NAMES = (
    "batch-ilp",
    "batch-ilp-sfs",
    "latency-agnostic",
    "latency-aware",
    "per-query-robust",
    "prefix-affinity",
    "round-robin",
    "shortest-queue",
)
POLICY_HELP = f"Routing policy: {', '.join(POLICY_NAMES)}; or package.module:factory"


def register(app: typer.Typer) -> None:
    @app.command("router")
    def router(
        cluster: Path = typer.Option(
            DEFAULT_CLUSTER,
            "--cluster",
            envvar="SWITCHYARD_CLUSTER",
            help="Cluster YAML/JSON (models, instances, tenants)",
        ),
        policy: str = typer.Option(DEFAULT_POLICY, "--policy", help=POLICY_HELP),
        predictor: Path | None = typer.Option(
            None,
            "--predictor",
            help="Quality predictor artefact (default: trained once from the vendored "
            "routing data and cached under $SWITCHYARD_HOME/predictors)",
        ),
        policy_opt: list[str] = typer.Option(
            [],
            "--policy-opt",
            help="A policy knob as key=value (repeat): e.g. delta=0.1, gap_tol=0.01, "
            "deadline_ms=20, robust=false; the effective values are printed at start",
        ),
        window_ms: float = typer.Option(50.0, "--window-ms", min=1.0, help="Routing window"),
        max_batch: int = typer.Option(
            MAX_BATCH, "--max-batch", min=1, help="Queries per window at most"
        ),
        partitions: int = typer.Option(
            4, "--partitions", min=1, help="Partitions of topics it creates"
        ),
        fetch_wait_ms: float | None = typer.Option(
            None,
            "--fetch-wait-ms",
            min=0.0,
            help="A fetch of `queries` waits this long for --fetch-min-kib at most (default: "
            "half the window; it counts toward the window, as queries are timed from when "
            "they were produced)",
        ),
        fetch_min_kib: int = typer.Option(
            64, "--fetch-min-kib", min=1, help="A fetch of `queries` returns once this much waits"
        ),
        stale_after_s: float = typer.Option(
            2.0, "--stale-after-s", help="Snapshot age that means stale"
        ),
        budget_hold_s: float = typer.Option(
            BUDGET_HOLD_S, "--budget-hold-s", help="Give up on a query deferred for budget after"
        ),
        max_hold_s: float = typer.Option(
            MAX_HOLD_S, "--max-hold-s", help="Give up on a query waiting for capacity after"
        ),
        shed_backlog: int = typer.Option(
            SHED_BACKLOG,
            "--shed-backlog",
            min=0,
            help="Load shedding: past this many queries waiting in the router (held + read), "
            "shed the excess, earliest deadline first (a Decision and an error Result with "
            "code shed each); 0: off",
        ),
        shed_after_slo: float = typer.Option(
            SHED_AFTER_SLO,
            "--shed-after-slo",
            min=0.0,
            help="Load shedding: shed a query that waited this many times its TTFT SLO since "
            "it was sent (1: its SLO can no longer be met); 0: off",
        ),
        dedupe_ttl_s: float = typer.Option(
            3600.0,
            "--dedupe-ttl-s",
            help="How long a routed query's dedupe entry is kept in Redis (a redelivered or "
            "re-sent query id within it is dropped, or re-sent as first decided). It must "
            "outlive a held query's wait and a crashed router's hand-over; each entry takes "
            "~0.5 KB, so at R queries/s Redis holds ~R x this x 0.5 KB",
        ),
        pacing: float = typer.Option(
            0.0,
            "--pacing",
            help="Window budget = remaining × min(1, pacing × window / period left); 0: off",
        ),
        metrics_port: int = typer.Option(
            0, "--metrics-port", help="Prometheus /metrics port (0: none)"
        ),
        metrics_host: str = typer.Option(
            "127.0.0.1", "--metrics-host", help="Address /metrics listens on (0.0.0.0: all)"
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
        online_step_time: bool = typer.Option(
            True,
            "--online-step-time/--configured-step-time",
            help="SFS uses the Eq. 9 coefficients the workers refit online (read from Redis "
            "with each window's snapshot), else the cluster config's",
        ),
        step_time_max_age_s: float = typer.Option(
            600.0,
            "--step-time-max-age-s",
            min=1.0,
            help="Online coefficients older than this are ignored (the configured ones apply)",
        ),
        blas_threads: int = typer.Option(
            1,
            "--blas-threads",
            min=0,
            help="numpy BLAS threads (the quality predictor's products); 0: BLAS's own "
            "default. One by default: spare threads busy-wait on cores the broker and Redis share",
        ),
        loglevel: str = typer.Option("WARNING", "--loglevel"),
    ) -> None:
        """Route queries from `queries` to `route.<instance>` in windows."""
        if blas_threads:
            from offline.blas import limit_blas_threads

            limit_blas_threads(blas_threads)
        # an entry must outlive the longest a query stays unacknowledged here (held) plus the
        # consumer group's hand-over of a crashed router's partitions, or a redelivery after
        # the crash would be routed a second time
        from streams.service import RouterConfig

        group_session_s = RouterConfig.group_session_s
        longest_hold_s = max(max_hold_s, budget_hold_s)
        shortest_ttl_s = longest_hold_s + group_session_s
        if dedupe_ttl_s < shortest_ttl_s:
            typer.echo(
                f"error: --dedupe-ttl-s {dedupe_ttl_s:g} is shorter than a held query can wait "
                f"plus a crashed router's hand-over ({longest_hold_s:g} + "
                f"{group_session_s:g} s): a query redelivered after a crash would be routed "
                f"twice; use at least {shortest_ttl_s:g}",
                err=True,
            )
            raise typer.Exit(2)
        from routing.policies.registry import effective_options, parse_options
        from schemas import ClusterConfig
        from streams.app import create_app, run
        from streams.metrics import RouterMetrics
        from streams.policy import PolicyError, load_router
        from streams.rescue import RescueConfig
        from switchyard.logs import configure_logging, logging_dict_config
        from wiring import kafka_admin, topics
        from wiring.paths import state_dir
        from wiring.settings import Settings, SettingsError

        configure_logging(loglevel)
        try:
            settings = Settings.from_env()
            spec = ClusterConfig.from_file(cluster)
            options = parse_options(policy_opt)  # a mistake is named before any training
            shown = effective_options(policy, **options) if ":" not in policy else options
            if predictor is None and ":" not in policy:
                predictor = _default_predictor()
            chosen = load_router(policy, spec, predictor, options)
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
            metrics.serve(metrics_port, metrics_host)
        config = RouterConfig(
            window_s=window_ms / 1000.0,
            dedupe_ttl_s=dedupe_ttl_s,
            max_batch=max_batch,
            fetch_min_bytes=fetch_min_kib * 1024,
            fetch_wait_s=None if fetch_wait_ms is None else fetch_wait_ms / 1000.0,
            stale_after_s=stale_after_s,
            max_hold_s=max_hold_s,
            budget_hold_s=budget_hold_s,
            shed_backlog=shed_backlog,
            shed_after_slo=shed_after_slo,
            pacing_factor=pacing,
            online_step_time=online_step_time,
            step_time_max_age_s=step_time_max_age_s,
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
            datadir=state_dir() / "faust" / app_id,
        )
        typer.echo(
            f"router {app_id}: policy {getattr(chosen, 'name', policy)}, window {window_ms:g} ms "
            f"(fetch wait {config.fetch_wait * 1000:g} ms), "
            f"max batch {max_batch}, shedding "
            f"{_shedding(shed_backlog, shed_after_slo)}, {len(spec.instances)} instances, "
            f"Kafka {settings.kafka}, "
            f"Redis {settings.redis_display()}",
            err=True,
        )
        typer.echo(f"router {app_id}: service config {_config_line(config)}", err=True)
        typer.echo(
            f"router {app_id}: policy options "
            + (", ".join(f"{k}={v}" for k, v in shown.items()) or "none"),
            err=True,
        )
        run(runtime, loglevel=loglevel, logging_config=logging_dict_config(loglevel))


def _shedding(backlog: int, after_slo: float) -> str:
    """The load-shedding rules in force, in words (for the start-up line)."""
    rules = [f"past a backlog of {backlog}"] if backlog else []
    rules += [f"after {after_slo:g} x the TTFT SLO"] if after_slo else []
    return " or ".join(rules) or "off"


def _default_predictor() -> Path:
    """The shipped recipe's artefact: trained on first use (with progress), then cached."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from offline.predictor import DEFAULT_RECIPE, cached_path, ensure_default_predictor
    from wiring.paths import state_dir

    cache = state_dir() / "predictors"
    if cached_path(cache, DEFAULT_RECIPE).exists():
        return cached_path(cache, DEFAULT_RECIPE)
    console = Console(stderr=True)
    console.print(
        "no --predictor: training the default quality predictor from the vendored routing "
        f"data once (cached in {cache}) …"
    )
    cols = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=False) as bar:
        task = bar.add_task("predictor", total=3)

        def step(msg: str) -> None:
            bar.update(task, description=msg, advance=1)

        path = ensure_default_predictor(cache, DEFAULT_RECIPE, step)
        bar.update(task, completed=3)
    return path


def _config_line(config: DataclassInstance) -> str:
    """Every field of a config dataclass with the value it runs with (logged at start)."""
    from dataclasses import asdict

    return ", ".join(f"{k}={v}" for k, v in asdict(config).items())
