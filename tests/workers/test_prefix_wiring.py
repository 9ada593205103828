"""The worker's side of the prefix-cache model (issue 14, item 3): each heartbeat's scrape of
the engine's counters feeds ``PrefixReconciler``, each request started feeds the router's
prediction (``Decision.predicted_cached_tokens``), and a new capacity goes out with the
worker's next touch. No Kafka or Redis: the backend and the state are stand-ins."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from schemas import ClusterConfig, Decision, DecisionStatus, Query, RoutedQuery
from state.prefix import touch_of
from wiring.settings import Settings
from workers.backends.base import EngineLoad
from workers.backends.vllm import parse_engine_load
from workers.worker import Worker, WorkerConfig

SAMPLE = Path(__file__).resolve().parents[2].parent / "shared" / "vllm" / "metrics_sample.txt"


class _Backend:
    name = "vllm"

    def __init__(self) -> None:
        self.counters: tuple[float, float] | None = (0.0, 0.0)

    async def engine_load(self) -> EngineLoad:
        return EngineLoad(running=0, waiting=0, prefix_counters=self.counters)

    async def model_problem(self) -> str | None:
        return None


class _State:
    def __init__(self) -> None:
        self.heartbeats = 0

    async def heartbeat(self, *a: Any, **kw: Any) -> None:
        self.heartbeats += 1


def _worker(backend: _Backend) -> Worker:
    cluster = ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "input_usd_per_token": 1e-7,
                    "output_usd_per_token": 1e-7,
                    "scheduler": {"kv_blocks": 1000, "block_size_tokens": 64},
                }
            ],
            "instances": [{"id": "m-0", "model": "m", "endpoint": "http://127.0.0.1:1"}],
        }
    )
    cfg = WorkerConfig(instance_id="m-0", online_step_time=False)
    return Worker(cfg, cluster, backend, Settings(), _State())  # type: ignore[arg-type]


def _routed(qid: str, cached: int | None) -> RoutedQuery:
    q = Query(id=qid, prompt="p", prompt_tokens=20_000, prefix_hashes=list(range(1, 40)),
              prefix_block_tokens=512)  # fmt: skip
    d = Decision(query_id=qid, tenant="default", status=DecisionStatus.ROUTED,
                 instance_id="m-0", model="m", policy="p", decided_at=time.time(),
                 predicted_cached_tokens=cached)  # fmt: skip
    return RoutedQuery(query=q, decision=d)


def _gauge(w: Worker, name: str) -> float:
    for line in w.metrics.render().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


async def test_scrapes_and_predictions_reconcile_the_capacity_the_next_touch_stores() -> None:
    backend = _Backend()
    w = _worker(backend)
    kv = 1000 * 64.0
    assert w.prefix_reconciler is not None and w.prefix_capacity_tokens is None
    assert _gauge(w, "switchyard_worker_prefix_capacity_tokens") == kv
    await w._heartbeat_once(resync=False)  # the baseline
    # the model predicted 16k cached tokens for each of two requests; the engine found 8k each
    for i in range(2):
        rq = _routed(f"q{i}", 16_000)
        w._prefix_started(rq, rq.query.estimated_prompt_tokens())
    backend.counters = (40_000.0, 16_000.0)
    await w._heartbeat_once(resync=False)
    assert w.prefix_capacity_tokens == pytest.approx(kv / 2)  # halved (the most per scrape)
    assert _gauge(w, "switchyard_worker_engine_prefix_hit_rate") == pytest.approx(0.4)
    assert _gauge(w, "switchyard_worker_model_prefix_hit_rate") == pytest.approx(0.8)
    assert _gauge(w, "switchyard_worker_prefix_capacity_tokens") == pytest.approx(kv / 2)
    # the worker's next touch stores it, so the routers' touches evict down to it too
    touch = touch_of(w.instance_id, _routed("q9", None).query, w.spec, w.prefix_capacity_tokens)
    assert touch is not None and touch.set_capacity and touch.capacity_tokens == kv / 2
    plain = touch_of(w.instance_id, _routed("q9", None).query, w.spec)
    assert plain is not None and not plain.set_capacity and plain.capacity_tokens == kv
    # the model now agrees with the engine: unchanged; a router that said nothing counts as 0
    w._prefix_started(_routed("q2", 8_000), 20_000)
    w._prefix_started(_routed("q3", None), 20_000)
    backend.counters = (80_000.0, 24_000.0)
    await w._heartbeat_once(resync=False)
    assert w.prefix_capacity_tokens == pytest.approx(kv / 2)
    # an engine without the counters (fake-vllm, prefix caching off) changes nothing
    backend.counters = None
    await w._heartbeat_once(resync=False)
    assert w.prefix_capacity_tokens == pytest.approx(kv / 2)


def test_the_engine_load_carries_real_vllms_prefix_counters() -> None:
    if not SAMPLE.exists():
        pytest.skip(f"no recorded vLLM /metrics page at {SAMPLE}")
    load = parse_engine_load(SAMPLE.read_text())  # a real vLLM 0.32 CPU server's page
    assert load.prefix_counters == (29.0, 0.0)
    assert parse_engine_load("vllm:num_requests_running 2\n").prefix_counters is None


def test_a_cloud_model_has_no_reconciler() -> None:
    cluster = ClusterConfig.model_validate(
        {
            "models": [{"name": "c", "kind": "cloud", "input_usd_per_token": 1e-6,
                        "output_usd_per_token": 1e-6}],  # fmt: skip
            "instances": [{"id": "c-0", "model": "c", "endpoint": "https://example.invalid/v1"}],
        }
    )
    w = Worker(WorkerConfig(instance_id="c-0", online_step_time=False), cluster, _Backend(),
               Settings(), _State())  # type: ignore[arg-type]  # fmt: skip
    assert w.prefix_reconciler is None
    w._prefix_started(_routed("q", 100), 20_000)  # a no-op


async def test_fake_vllm_counts_prefix_hits_and_the_backend_reads_them() -> None:
    """fake-vllm caches a prompt's text blocks (schemas.prefix) like vLLM's prefix caching
    and exports ``vllm:prefix_cache_*``; ``VllmBackend.engine_load`` hands them on."""
    from schemas import SchedulerConfig, StepTimeCoefficients
    from workers.backends.base import GenerationRequest
    from workers.backends.vllm import VllmBackend, VllmConfig
    from workers.fake_vllm import FakeVllmConfig, build_server, start_server

    coef = StepTimeCoefficients(c0_ms=2.0, c1_ms_per_token=0.01, c2_ms_per_ctx_token=0.0,
                                c3_ms_per_attn_unit=0.0)  # fmt: skip
    for caching in (True, False):
        srv = await start_server(build_server(
            coefficients=coef, scheduler=SchedulerConfig(prefix_caching=caching),
            config=FakeVllmConfig(model="m"), time_scale=10.0))  # fmt: skip
        be = VllmBackend(VllmConfig(endpoint=srv.url, model="m"))
        await be.start()
        try:
            first = "word " * 1000  # 5000 bytes: 4 whole 1 KiB blocks
            for i, text in enumerate((first, first + "and more " * 200)):
                q = Query(id=f"q{i}", prompt=text, max_tokens=2)
                gen = await be.generate(GenerationRequest(q, f"r{i}", q.estimated_prompt_tokens(), 2),
                                        lambda p, d: None)  # fmt: skip
                assert gen.error is None
            load = await be.engine_load()
            assert load.prefix_counters is not None
            queried, hits = load.prefix_counters
            if caching:
                assert queried == pytest.approx(1250 + 1700)  # both prompts looked up
                assert hits == 4 * 256  # the second finds the first's 4 whole blocks cached
            else:
                assert (queried, hits) == (0.0, 0.0)  # prefix caching off: no lookups
        finally:
            await be.close()
            await srv.stop()
