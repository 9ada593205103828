"""``switchyard worker`` (one instance's consumer) and ``switchyard fake-vllm`` (a simulated vLLM server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import typer

from wiring.paths import DEFAULT_CLUSTER


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)


def _describe(exc: BaseException) -> str:
    """One readable line for a config error (pydantic errors name the field and the rule)."""
    from pydantic import ValidationError

    from schemas.errors import describe_validation_error

    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def register(app: typer.Typer) -> None:
    @app.command("worker")
    def worker(
        instance: str = typer.Option(
            ..., "--instance", help="Instance id (as in the cluster file)"
        ),
        cluster: Path = typer.Option(
            DEFAULT_CLUSTER,
            "--cluster",
            envvar="SWITCHYARD_CLUSTER",
            help="Cluster config (.yaml/.json)",
            exists=True,
            dir_okay=False,
        ),
        backend: str = typer.Option(
            "vllm", "--backend", help="vllm (OpenAI-compatible HTTP) or sim (in-process)"
        ),
        endpoint: str | None = typer.Option(
            None, "--endpoint", help="Server base URL (default: the instance's endpoint)"
        ),
        concurrency: int | None = typer.Option(
            None, "--concurrency", min=1, help="Default: the model's max_concurrency"
        ),
        served_model: str | None = typer.Option(
            None, "--served-model", help="Model name the server expects"
        ),
        heartbeat_s: float = typer.Option(1.0, "--heartbeat-s", min=0.05),
        engine_start_timeout_s: float = typer.Option(
            600.0, "--engine-start-timeout-s", min=0.0,
            help="Wait this long for the engine's /v1/models before consuming (no heartbeat "
            "meanwhile); past it, consume with the instance unavailable",
        ),
        metrics_port: int | None = typer.Option(
            None, "--metrics-port", help="Serve Prometheus /metrics here"
        ),
        metrics_host: str = typer.Option("127.0.0.1", "--metrics-host"),
        time_scale: float = typer.Option(
            1.0, "--time-scale", help="sim backend: engine seconds per wall second"
        ),
        seed: int = typer.Option(0, "--seed"),
        online_step_time: bool = typer.Option(
            True,
            "--online-step-time/--no-online-step-time",
            help="Refit the model's Eq. 9 coefficients from what this worker observes and "
            "publish them to Redis for the routers' SFS",
        ),
        step_time_refit_s: float = typer.Option(
            5.0, "--step-time-refit-s", min=0.1, max=3600.0, help="Refit and publish every"
        ),
        log_level: str = typer.Option("WARNING", "--log-level"),
    ) -> None:
        """Consume route.<INSTANCE>, run the backend, publish results (at-least-once)."""
        from switchyard.logs import configure_logging

        configure_logging(log_level)
        from schemas import ClusterConfig
        from wiring.settings import Settings, SettingsError

        try:
            cfg = ClusterConfig.from_file(cluster)
            spec = cfg.model_of(instance)
            settings = Settings.from_env()
        except (KeyError, ValueError, OSError, SettingsError) as exc:
            raise _fail(f"{cluster}: {_describe(exc)}") from None
        try:
            be = _backend(
                backend, cfg, instance, spec, endpoint, served_model, time_scale, seed,
                concurrency, heartbeat_s, settings,
            )  # fmt: skip
        except ValueError as exc:
            raise _fail(_describe(exc)) from None
        code = asyncio.run(
            _run_worker(
                cfg, instance, be, settings, concurrency, heartbeat_s, metrics_host, metrics_port,
                engine_start_timeout_s, online_step_time, step_time_refit_s,
            )  # fmt: skip
        )
        raise typer.Exit(code)

    @app.command("fake-vllm")
    def fake_vllm(
        profile: str | None = typer.Option(
            None, "--profile", help="Step-time profile, e.g. llama-2-7b-hf@h100"
        ),
        port: int = typer.Option(8000, "--port", min=0, max=65535),
        host: str = typer.Option("127.0.0.1", "--host"),
        time_scale: float = typer.Option(
            1.0, "--time-scale", help="Engine seconds per wall second (10: 10x faster)"
        ),
        coefficients: str | None = typer.Option(
            None, "--coefficients", help="Eq. 9 c0,c1,c2,c3 in ms (instead of a profile)"
        ),
        cluster: Path | None = typer.Option(
            None,
            "--cluster",
            envvar="SWITCHYARD_CLUSTER",
            help="Take model, profile and scheduler from this file (with --instance), or "
            "the model name for --profile (default: the demo cluster)",
        ),
        instance: str | None = typer.Option(
            None, "--instance", help="With --cluster: serve this instance's model"
        ),
        model: str | None = typer.Option(
            None, "--model", help="Served model name (default: profile or model name)"
        ),
        max_model_len: int = typer.Option(32_768, "--max-model-len", min=2),
        mean_output_tokens: float = typer.Option(128.0, "--mean-output-tokens", min=1.0),
        error_rate: float = typer.Option(0.0, "--error-rate", min=0.0, max=1.0),
        noise_sigma: float = typer.Option(0.0, "--noise-sigma", min=0.0),
        seed: int = typer.Option(0, "--seed"),
        no_usage: bool = typer.Option(
            False, "--no-usage", help="Ignore stream_options.include_usage"
        ),
        log_level: str = typer.Option("WARNING", "--log-level"),
    ) -> None:
        """Serve the OpenAI API (vLLM flavour) over the simulated engine in wall-clock time.

        The served model name: --model; else the model of --cluster/--instance; else the
        model that --profile serves in the cluster (--cluster, default the demo cluster),
        so that workers of that cluster find it; else the profile name.
        """
        from switchyard.logs import configure_logging

        configure_logging(log_level)
        from schemas import ClusterConfig, SchedulerConfig
        from workers.fake_vllm import FakeVllmConfig, build_server
        from workers.realtime import parse_coefficients

        sched = SchedulerConfig()
        coef: Any = None
        served = model
        try:
            if instance is None and served is None and profile:
                served = served_name_for_profile(profile, cluster or DEFAULT_CLUSTER)
            if cluster is not None and instance is not None:
                spec = ClusterConfig.from_file(cluster).model_of(instance)
                sched, coef, profile = spec.scheduler, spec.step_time, profile or spec.profile
                served = served or spec.name
                mean_output_tokens = spec.mean_output_tokens or mean_output_tokens
            if coefficients is not None:
                coef = parse_coefficients(coefficients)
            if instance is not None and cluster is None:
                raise ValueError("--instance needs --cluster FILE")
            if coef is None and not profile:
                raise ValueError(
                    "give --profile NAME, --coefficients c0,c1,c2,c3 or --cluster FILE --instance ID"
                )
            server = build_server(
                profile=profile,
                coefficients=coef,
                scheduler=sched,
                time_scale=time_scale,
                noise_sigma=noise_sigma,
                config=FakeVllmConfig(
                    model=served or profile or "sim-model",
                    max_model_len=max_model_len,
                    mean_output_tokens=mean_output_tokens,
                    error_rate=error_rate,
                    honour_include_usage=not no_usage,
                    seed=seed,
                ),
            )
        except (KeyError, ValueError, OSError) as exc:
            raise _fail(_describe(exc)) from None
        asyncio.run(_serve(server, host, port))


def served_name_for_profile(profile: str, cluster: Path) -> str | None:
    """The model that ``profile`` serves in ``cluster`` (the one its workers ask for).

    None (serve the profile's name) when no model uses the profile; ``ValueError`` when
    several do (``--model`` or ``--instance`` must say which).
    """
    from schemas import ClusterConfig

    if not cluster.exists():
        return None
    names = [m.name for m in ClusterConfig.from_file(cluster).models if m.profile == profile]
    if len(names) > 1:
        raise ValueError(
            f"models {names} of {cluster} all use profile {profile!r}: pass --model NAME "
            "or --cluster FILE --instance ID"
        )
    return names[0] if names else None


def _backend(
    kind: str,
    cfg: Any,
    instance: str,
    spec: Any,
    endpoint: str | None,
    served_model: str | None,
    time_scale: float,
    seed: int,
    concurrency: int | None,
    heartbeat_s: float = 1.0,
    settings: Any = None,
) -> Any:
    """The worker's backend. ``vllm`` serves any OpenAI-compatible endpoint: a vLLM server
    (liveness from ``/health``, the engine's counts from ``/metrics``) or, for a model of
    kind ``cloud``, a provider's (liveness from ``/v1/models``, no counts); the bearer
    token is ``SWITCHYARD_ENGINE_API_KEY`` (``settings.engine_api_key``) when set."""
    if kind == "vllm":
        from workers.backends.vllm import VllmBackend, VllmConfig

        url = endpoint or cfg.instance(instance).endpoint
        key = getattr(settings, "engine_api_key", None)
        cloud = spec.kind == "cloud"
        if not url:
            raise ValueError(
                f"instance {instance!r} has no endpoint in the cluster file; pass --endpoint URL"
            )
        return VllmBackend(
            VllmConfig(
                endpoint=url,
                model=served_model or spec.name,
                max_connections=(concurrency or spec.max_concurrency) + 8,
                max_output_tokens=spec.max_output_tokens,
                # a probe that outlasts a heartbeat would hide a frozen engine for longer
                health_timeout_s=max(0.2, min(1.0, heartbeat_s)),
                api_key=key.get_secret_value() if key is not None else None,
                probe_path="/v1/models" if cloud else "/health",
                read_metrics=not cloud,
            )
        )
    if kind == "sim":
        from workers.backends.sim import SimBackend

        return SimBackend(spec, instance_id=instance, time_scale=time_scale, seed=seed)
    raise ValueError(f"--backend must be vllm or sim, got {kind!r}")


async def _run_worker(
    cfg: Any,
    instance: str,
    backend: Any,
    settings: Any,
    concurrency: int | None,
    heartbeat_s: float,
    metrics_host: str,
    metrics_port: int | None,
    engine_start_timeout_s: float = 600.0,
    online_step_time: bool = True,
    step_time_refit_s: float = 5.0,
) -> int:
    from state import StateStore, StateUnavailable
    from workers.worker import Worker, WorkerConfig, WorkerFatal

    log = logging.getLogger("switchyard.worker")
    try:
        state = await StateStore.connect(**settings.redis_kwargs())
    except (StateUnavailable, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    stop = asyncio.Event()
    _stop_on_signals(stop)
    w = Worker(
        WorkerConfig(
            instance_id=instance,
            concurrency=concurrency,
            heartbeat_s=heartbeat_s,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            engine_start_timeout_s=engine_start_timeout_s,
            online_step_time=online_step_time,
            step_time_refit_s=step_time_refit_s,
        ),
        cfg,
        backend,
        settings,
        state,
    )
    # the two lines a worker always says (start and stop), whatever the log level
    typer.echo(
        f"worker {instance}: {backend.name} backend, model {w.spec.name}, concurrency "
        f"{w.concurrency}, Kafka {settings.kafka}, Redis {settings.redis_display()}",
        err=True,
    )
    try:
        await w.run(stop)
    except WorkerFatal as exc:
        log.error("%s", exc)
        return 1
    finally:
        await state.close()
    typer.echo(f"worker {instance} stopped: {w.counts}", err=True)
    return 0


async def _serve(server: Any, host: str, port: int) -> None:
    from workers.fake_vllm import start_server

    stop = asyncio.Event()
    _stop_on_signals(stop)
    running = await start_server(server, host, port)
    print(f"fake-vllm serving {server.config.model} on {running.url}", flush=True, file=sys.stdout)
    try:
        await stop.wait()
    finally:
        await running.stop()
