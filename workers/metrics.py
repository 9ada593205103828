"""Prometheus metrics of one worker (its own registry, so tests can run several in-process)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    def __init__(self, instance_id: str, model: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lab = {"instance": instance_id, "model": model}
        names = list(lab)

        def g(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r)

        self.in_flight = g("switchyard_worker_in_flight", "Requests running on the backend").labels(
            **lab
        )
        self.engine_up = g(
            "switchyard_worker_engine_up",
            "1 while the engine answers its health probe (the instance heart-beats), else 0",
        ).labels(**lab)
        self.engine_prefix_hit_rate = g(
            "switchyard_worker_engine_prefix_hit_rate",
            "The engine's own prefix-cache hit rate since it started (vLLM "
            "prefix_cache_hits_total / prefix_cache_queries_total)",
        ).labels(**lab)
        self.model_prefix_hit_rate = g(
            "switchyard_worker_model_prefix_hit_rate",
            "The router's prefix model's predicted hit rate over the requests this worker "
            "started (predicted cached prompt tokens / prompt tokens)",
        ).labels(**lab)
        self.prefix_capacity_tokens = g(
            "switchyard_worker_prefix_capacity_tokens",
            "Capacity of the instance's prefix-cache model (the KV cache, until reconciled "
            "with the engine's counters)",
        ).labels(**lab)
        self.queued = g(
            "switchyard_worker_queued", "Requests received, waiting for a backend slot"
        ).labels(**lab)
        self._results = Counter(
            "switchyard_worker_results", "Results published", [*names, "outcome"], registry=r
        )
        self.results_ok = self._results.labels(**lab, outcome="ok")
        self.results_error = self._results.labels(**lab, outcome="error")
        self._errors = Counter(
            "switchyard_worker_errors", "Errors by kind", [*names, "kind"], registry=r
        )
        self.dead_letters = Counter(
            "switchyard_worker_dead_letters", "Bad routed messages", names, registry=r
        ).labels(**lab)
        self.duplicates_skipped = Counter(
            "switchyard_worker_duplicates_skipped",
            "Queries skipped: result already published",
            names,
            registry=r,
        ).labels(**lab)
        self.duplicate_results = Counter(
            "switchyard_worker_duplicate_results",
            "Results published again (inference repeated)",
            names,
            registry=r,
        ).labels(**lab)
        self.reruns = Counter(
            "switchyard_worker_reruns",
            "Queries started again after a re-delivery (repeated inference)",
            names,
            registry=r,
        ).labels(**lab)
        self.rate_paced_s = Counter(
            "switchyard_worker_rate_paced_seconds",
            "Seconds queries waited for their turn under the model's rate_limit_rps",
            names,
            registry=r,
        ).labels(**lab)
        self.cost_usd = Counter(
            "switchyard_worker_cost_usd", "Cost of published results", names, registry=r
        ).labels(**lab)
        self._slo = Counter(
            "switchyard_worker_slo",
            "Results by whether their TTFT met the query's SLO",
            [*names, "outcome"],
            registry=r,
        )
        self.slo_met = self._slo.labels(**lab, outcome="met")
        self.slo_missed = self._slo.labels(**lab, outcome="missed")
        self.output_tokens = Counter(
            "switchyard_worker_output_tokens", "Tokens generated", names, registry=r
        ).labels(**lab)
        self.ttft = Histogram(
            "switchyard_worker_ttft_seconds",
            "Engine TTFT (sent → first token)",
            names,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(**lab)
        self.e2e = Histogram(
            "switchyard_worker_e2e_seconds",
            "Engine end-to-end time",
            names,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(**lab)
        self.step_time_coefficient = Gauge(
            "switchyard_worker_step_time_coefficient",
            "Eq. 9 coefficients refitted online from what this worker observes (ms per unit)",
            [*names, "coefficient"],
            registry=r,
        )
        self.step_time_rows = Gauge(
            "switchyard_worker_step_time_rows",
            "Observations in the online refit's window",
            names,
            registry=r,
        ).labels(**lab)
        self.step_time_version = Gauge(
            "switchyard_worker_step_time_version",
            "Version of the coefficients last published to Redis (0: none yet)",
            names,
            registry=r,
        ).labels(**lab)
        self.step_time_fit_error = Gauge(
            "switchyard_worker_step_time_fit_error",
            "The refit's mean relative error on its window's rows",
            names,
            registry=r,
        ).labels(**lab)
        self._live_ttft_error = Gauge(
            "switchyard_worker_live_ttft_error",
            "Mean |predicted - measured| / measured TTFT of recent requests; source=router: "
            "the router's SFS prediction at decision time, source=refit: the current "
            "coefficients on the engine-side TTFT",
            [*names, "source"],
            registry=r,
        )
        self._lab = lab

    def live_ttft_error(self, source: str, value: float) -> None:
        self._live_ttft_error.labels(**self._lab, source=source).set(value)

    def step_time(self, coef: dict[str, float]) -> None:
        for name, value in coef.items():
            self.step_time_coefficient.labels(**self._lab, coefficient=name).set(value)

    def error(self, kind: str) -> None:
        self._errors.labels(**self._lab, kind=kind).inc()

    def errors(self, kind: str) -> float:
        return float(self._errors.labels(**self._lab, kind=kind)._value.get())

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_metrics(metrics: WorkerMetrics, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``/metrics`` on ``host:port`` (0: a free port); return the runner and the port."""

    async def handler(_req: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    bound = (
        int(server.sockets[0].getsockname()[1])
        if server is not None and hasattr(server, "sockets")
        else port
    )
    return runner, bound
