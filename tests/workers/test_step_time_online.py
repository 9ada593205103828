"""Online recalibration of Eq. 9 end to end on the real Kafka broker and Redis: a worker whose
cluster config carries the wrong coefficients (the H100 7B profile) serves a simulated engine
priced by other, known ones; what it observes refits them, it publishes them to Redis, and the
router's snapshot read hands them to SFS."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import numpy as np
import pytest

from loaders.profiles import load_profile
from routing.policies.context import SfsTtft
from routing.steptime import StepTimeModel
from routing.types import InstanceState, InstanceView
from schemas import ClusterConfig, Decision, Query, RoutedQuery
from state import StateStore, period_id
from streams.views import instance_views, live_step_models
from switchyard.client import SwitchyardClient
from tests.workers.test_worker import _produce, running
from wiring import topics
from workers.backends.sim import SimBackend
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration

TRUE = StepTimeModel(9.0, 0.06, 0.0008, 2.0e-6)  # what the (simulated) engine really costs
WRONG = load_profile("llama-2-7b-hf@h100")  # what the cluster config says
SCHED = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_blocks": 16384}


def _cluster(iid: str, coef: StepTimeModel) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "tiny",
                    "input_usd_per_token": 1e-7,
                    "output_usd_per_token": 1e-7,
                    "max_concurrency": 8,
                    "step_time": coef.to_coefficients().model_dump(),
                    "scheduler": SCHED,
                }
            ],
            "instances": [{"id": iid, "model": "tiny"}],
            "tenants": [{"tenant": "acme", "budget_usd": 10.0, "period_s": 3600}],
        }
    )


def _routed(qid: str, iid: str, period: str, words: int, max_tokens: int) -> RoutedQuery:
    now = time.time()
    q = Query(id=qid, tenant="acme", prompt="word " * words, max_tokens=max_tokens, created_at=now)
    d = Decision(
        query_id=qid, tenant="acme", status="routed", instance_id=iid, model="tiny",
        policy="test", decided_at=now, budget_period=period,
        predicted_output_tokens=max_tokens, predicted_cost_usd=0.001,
    )  # fmt: skip
    return RoutedQuery(query=q, decision=d)


def _err(got: StepTimeModel, prompts: list[int]) -> float:
    p = np.array(prompts)
    return float(np.max(np.abs(got.prefill_ms(p) - TRUE.prefill_ms(p)) / TRUE.prefill_ms(p)))


async def test_a_worker_started_with_the_wrong_profile_converges_and_the_router_reads_it(
    env: dict[str, Any],
) -> None:
    iid = "rc-" + uuid.uuid4().hex[:8]
    cluster = _cluster(iid, WRONG)
    engine_spec = _cluster(iid, TRUE).model("tiny")  # the engine runs on the true costs
    state: StateStore = env["state"]
    period = period_id(time.time(), 3600)
    rng = np.random.default_rng(7)
    backend = SimBackend(engine_spec, instance_id=iid, time_scale=1.0)
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.2, step_time_refit_s=0.5, metrics_port=0),
        cluster, backend, env["settings"], state,
    )  # fmt: skip
    assert worker.step_feed is not None and worker.step_feed.model == WRONG
    client: SwitchyardClient = env["client"]
    async with running(worker):
        for wave in range(6):  # bursts, so requests batch with each other
            if wave < 5:
                shape = [(int(rng.integers(40, 900)), int(rng.integers(4, 24))) for _ in range(12)]
            else:  # and one of long outputs: many steps of nothing but decodes
                shape = [(int(rng.integers(40, 400)), 60) for _ in range(4)]
            queries = [
                _routed(f"{iid}-{wave}-{i}", iid, period, words, out)
                for i, (words, out) in enumerate(shape)
            ]
            await _produce(
                env["producer"],
                topics.route(iid),
                [rq.model_dump_json().encode() for rq in queries],
            )
            for rq in queries:
                r = await client.result(rq.query.id, timeout_s=30)
                assert r.error is None
        await asyncio.sleep(1.2)  # the next refit publishes
        body = worker.metrics.render().decode()
        # what a router reads each window: snapshots and coefficients in one round trip
        live, records = await state.snapshots_and_step_times([iid], ["tiny"], time.time())
    feed = worker.step_feed
    assert feed.rows["ttft"] >= 50 and feed.rows["decode"] > 0

    rec = records["tiny"]
    assert rec.version >= 1 and rec.instance_id == iid and rec.rows >= 50
    got = StepTimeModel.from_coefficients(rec.coefficients)
    # on the TTFTs the worker measured, the refit prices as well as the engine's true
    # coefficients (better, even: it absorbs what the rows leave out), the config far worse
    X, y = feed.refitter.rows()

    def mape(m: StepTimeModel) -> float:
        return float(np.mean(np.abs(X @ m.coef - y) / y))

    print(f"row MAPE: refit {mape(got):.3f}, true {mape(TRUE):.3f}, configured {mape(WRONG):.3f}")
    assert mape(got) < mape(TRUE) + 0.05
    assert mape(WRONG) > 2 * mape(got) and mape(WRONG) > 0.3
    assert rec.fit_mape == pytest.approx(mape(got), abs=0.05)
    prompts = [64, 256, 700]
    print(
        f"lone prefill error: refit {_err(got, prompts):.3f}, configured {_err(WRONG, prompts):.3f}"
    )
    assert _err(got, prompts) < 0.4 < _err(WRONG, prompts)

    # the router side: the snapshot read hands the refit to SFS instead of the config
    steps = live_step_models(records, time.time(), max_age_s=600.0)
    sfs = SfsTtft(cluster, {"tiny": WRONG})
    busy = InstanceState(
        np.array([300, 500]), np.array([300, 0]), np.array([5, 0]), np.array([20, 20])
    )
    view = InstanceView(iid, "tiny", busy, 6, step_time=steps["tiny"])
    plain = InstanceView(iid, "tiny", busy, 6)
    truth = SfsTtft(cluster, {"tiny": TRUE}).standalone_ms(plain, np.array([400]), np.array([8]))
    online = sfs.standalone_ms(view, np.array([400]), np.array([8]))
    configured = sfs.standalone_ms(plain, np.array([400]), np.array([8]))
    assert abs(online[0] - truth[0]) / truth[0] < 0.25
    assert abs(configured[0] - truth[0]) / truth[0] > 0.5
    assert instance_views(cluster, live, time.time(), 2.0, step_time=steps)[0][0].step_time == got
    # an old record is not used
    assert live_step_models(records, time.time() + 601.0, max_age_s=600.0) == {}

    assert 'switchyard_worker_step_time_coefficient{coefficient="c1_ms_per_token"' in body
    assert "switchyard_worker_live_ttft_error" in body
    assert f'switchyard_worker_step_time_version{{instance="{iid}"' in body


def test_the_off_switch_and_models_without_coefficients() -> None:
    from wiring.settings import Settings

    cluster = _cluster("off-0", WRONG)
    backend = SimBackend(cluster.model("tiny"), instance_id="off-0")
    settings = Settings()
    off = Worker(
        WorkerConfig(instance_id="off-0", online_step_time=False), cluster, backend,
        settings, state=None,  # type: ignore[arg-type]
    )  # fmt: skip
    assert off.step_feed is None
    with pytest.raises(ValueError, match="step_time_ttl_s"):
        WorkerConfig(instance_id="x", step_time_refit_s=10.0, step_time_ttl_s=5.0)
