"""What the router sees: instance views from live state, and the window budget (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from schemas import (
    ClusterConfig,
    FinishedRequest,
    InstanceSnapshot,
    ResidentRequest,
    StepTimeCoefficients,
    TenantBudget,
)
from streams.views import (
    UNLIMITED_USD,
    instance_views,
    live_dispatch_ms,
    pacing_allowance,
    period_left_s,
    window_budget,
)

CLUSTER = ClusterConfig.model_validate(
    {
        "models": [
            {
                "name": "s",
                "input_usd_per_token": 1e-7,
                "output_usd_per_token": 1e-7,
                "max_concurrency": 8,
            },
            {
                "name": "l",
                "input_usd_per_token": 1e-6,
                "output_usd_per_token": 1e-6,
                "max_concurrency": 4,
            },
        ],
        "instances": [
            {"id": "s0", "model": "s"},
            {"id": "s1", "model": "s"},
            {"id": "l0", "model": "l"},
        ],
    }
)


@dataclass
class Live:
    snapshot: InstanceSnapshot | None
    slots_used: int
    alive: bool
    age_s: float
    engine_running: int | None = None
    engine_waiting: int | None = None
    engine_kv_usage: float | None = None
    prefix_hashes: npt.NDArray[np.uint64] | None = None


def snap(iid: str, taken_at: float, n: int = 2) -> InstanceSnapshot:
    residents = [
        ResidentRequest(query_id=f"{iid}-{k}", prompt_tokens=100, prefilled_tokens=100)
        for k in range(n)
    ]
    return InstanceSnapshot(instance_id=iid, model="s", taken_at=taken_at, residents=residents)


def test_views_fresh_stale_missing_and_dead() -> None:
    now = 1000.0
    live = {
        "s0": Live(snap("s0", now - 0.5), 3, True, 0.5),  # fresh: state, 5 free
        "s1": Live(snap("s1", now - 10.0), 8, True, 10.0),  # stale: no state, no free slot
        "l0": Live(None, 0, False, math.inf),  # no heartbeat: left out
    }
    views, excluded = instance_views(CLUSTER, live, now, stale_after_s=2.0)
    assert excluded == ["l0"]
    by_id = {v.instance_id: v for v in views}
    assert set(by_id) == {"s0", "s1"}
    assert by_id["s0"].state is not None and by_id["s0"].state.n == 2 and not by_id["s0"].stale
    assert by_id["s0"].free_slots == 5
    assert by_id["s1"].state is None and by_id["s1"].stale and by_id["s1"].free_slots == 0
    # slots held above the limit (another router's race) never give negative free slots
    live["s0"] = Live(snap("s0", now), 11, True, 0.0)
    views, _ = instance_views(CLUSTER, live, now, 2.0)
    assert views[0].free_slots == 0


def test_pacing_allowance_spends_evenly_and_zero_disables() -> None:
    assert pacing_allowance(10.0, 0.05, 100.0, 0.0) == 10.0
    assert pacing_allowance(10.0, 1.0, 100.0, 2.0) == pytest.approx(
        0.2
    )  # 2 × 1 s / 100 s of 10 USD
    assert pacing_allowance(10.0, 60.0, 10.0, 2.0) == 10.0  # never more than what is left
    assert pacing_allowance(0.0, 1.0, 100.0, 2.0) == 0.0
    assert period_left_s(3_605.0, 3_600.0) == pytest.approx(3_595.0)


def test_window_budget_is_min_of_remaining_and_allowance() -> None:
    budgets = {"a": TenantBudget(tenant="a", budget_usd=10.0, period_s=100.0)}
    budget, windows = window_budget(
        ["a", "b", "a"],
        budgets,
        {"a": 4.0},
        {"a": "100s-0"},
        now=50.0,
        elapsed_s=1.0,
        pacing_factor=5.0,
    )
    # a: 6 USD left, 50 s left in the period, allowance 6 × 5 × 1/50 = 0.6 USD
    assert budget.tenant_remaining_usd["a"] == pytest.approx(0.6)
    assert budget.tenant_remaining_usd["b"] == UNLIMITED_USD  # no budget configured
    assert windows["a"].remaining_usd == pytest.approx(6.0) and windows["a"].period_id == "100s-0"
    overspent, _ = window_budget(["a"], budgets, {"a": 12.0}, {"a": "100s-0"}, 50.0, 1.0, 0.0)
    assert overspent.tenant_remaining_usd["a"] == 0.0 and overspent.window_usd == 0.0


def test_a_view_holds_the_engine_counts_the_worker_did_not_list() -> None:
    live = {"s0": Live(snap("s0", 99.0, n=2), 2, True, 1.0, 3, 4),
            "s1": Live(snap("s1", 99.0, n=2), 2, True, 1.0, None, None)}  # fmt: skip
    views, _ = instance_views(CLUSTER, live, now=100.0, stale_after_s=5.0)
    by = {v.instance_id: v for v in views}
    s0, s1 = by["s0"].state, by["s1"].state
    assert s0 is not None and s1 is not None
    assert s0.n == 7 and int((s0.prefilled_tokens > 0).sum()) == 3
    assert s1.n == 2


def test_the_engine_kv_usage_sizes_the_requests_the_worker_did_not_list() -> None:
    """One unlisted running request and the engine's KV half full: the added row holds the
    half the listed rows do not (the cluster's kv_blocks x block size), not a typical prompt."""
    model = CLUSTER.model(CLUSTER.instances[0].model)
    capacity = model.scheduler.kv_blocks * model.scheduler.block_size_tokens
    s = snap("s0", 99.0, n=2)
    live = {"s0": Live(s, 2, True, 1.0, 3, 0, 0.5), "s1": Live(snap("s1", 99.0, n=2), 2, True, 1.0, 3, 0)}
    by = {v.instance_id: v.state for v in instance_views(CLUSTER, live, 100.0, 5.0)[0]}
    with_kv, without = by["s0"], by["s1"]
    assert with_kv is not None and without is not None and with_kv.n == without.n == 3
    listed = int(with_kv.prefilled_tokens[:2].sum() + with_kv.decoded_tokens[:2].sum())
    assert int(with_kv.prefilled_tokens[2]) == round(0.5 * capacity - listed)
    assert int(without.prefilled_tokens[2]) == int(round(without.prompt_tokens[:2].mean()))


def test_views_carry_each_instances_prefix_model() -> None:
    held = np.array([3, 9], dtype=np.uint64)
    live = {
        "s0": Live(snap("s0", 99.0), 0, True, 1.0, prefix_hashes=held),
        "s1": Live(snap("s1", 99.0), 0, True, 1.0),
    }
    views, _ = instance_views(CLUSTER, live, 100.0, 5.0)
    by = {v.instance_id: v.prefix_hashes for v in views}
    assert by["s0"] is held and by["s1"] is None


@dataclass
class StepRecord:
    coefficients: StepTimeCoefficients
    at: float
    dispatch_ms: float | None


def test_each_models_measured_dispatch_delay_reaches_its_views_while_fresh() -> None:
    coef = StepTimeCoefficients(
        c0_ms=5.0, c1_ms_per_token=0.02, c2_ms_per_ctx_token=1e-4, c3_ms_per_attn_unit=1e-6
    )
    recs = {"s": StepRecord(coef, 990.0, 42.0), "l": StepRecord(coef, 995.0, None)}
    assert live_dispatch_ms(recs, 1000.0, max_age_s=600.0) == {"s": 42.0}
    assert live_dispatch_ms(recs, 1591.0, max_age_s=600.0) == {}  # too old: not used
    live = {iid: Live(snap(iid, 999.5), 0, True, 0.5) for iid in ("s0", "s1", "l0")}
    views, _ = instance_views(
        CLUSTER, live, 1000.0, 2.0, dispatch_ms=live_dispatch_ms(recs, 1000.0, 600.0)
    )
    assert {v.instance_id: v.dispatch_ms for v in views} == {"s0": 42.0, "s1": 42.0, "l0": 0.0}


def test_views_carry_each_residents_time_at_the_engine() -> None:
    now = 1000.0
    rs = [
        ResidentRequest(query_id="a", prompt_tokens=100, arrived_at=now - 0.25),
        ResidentRequest(query_id="b", prompt_tokens=100, arrived_at=now + 1.0),  # clock skew
        ResidentRequest(query_id="c", prompt_tokens=100),  # no stamp: unknown
    ]
    s = InstanceSnapshot(instance_id="s0", model="s", taken_at=now - 0.1, residents=rs)
    live = {"s0": Live(s, 3, True, 0.1, engine_running=0, engine_waiting=5)}
    views, _ = instance_views(CLUSTER, live, now, stale_after_s=2.0)
    v = next(v for v in views if v.instance_id == "s0")
    assert v.state is not None and v.state.n == 5  # two waiting rows added from the engine
    assert v.waited_ms is not None
    assert v.waited_ms.tolist() == pytest.approx([250.0, 0.0, 0.0, 0.0, 0.0])
    stale = {"s0": Live(s, 3, True, 10.0)}
    views, _ = instance_views(CLUSTER, stale, now, stale_after_s=2.0)
    assert next(v for v in views if v.instance_id == "s0").waited_ms is None


def test_views_of_inferred_progress_models_carry_the_recently_finished_requests() -> None:
    now = 1000.0
    fin = [
        FinishedRequest(prompt_tokens=300, output_tokens=4, arrived_at=now - 0.5, finished_at=now - 0.2),
        # a writer's clock ahead of the reader's: it left "in the future", so just now
        FinishedRequest(prompt_tokens=50, output_tokens=1, arrived_at=now - 0.1, finished_at=now + 0.05),
    ]  # fmt: skip
    rs = [ResidentRequest(query_id="a", prompt_tokens=100, arrived_at=now - 0.25)]
    s = InstanceSnapshot(instance_id="s0", model="s", taken_at=now, residents=rs, finished=fin)
    live = {"s0": Live(s, 1, True, 0.0)}
    inferred = CLUSTER.model_copy(
        update={
            "models": [
                m.model_copy(update={"prefill_progress": "inferred"}) if m.name == "s" else m
                for m in CLUSTER.models
            ]
        }
    )
    views, _ = instance_views(inferred, live, now, stale_after_s=2.0)
    f = next(v for v in views if v.instance_id == "s0").finished
    assert f is not None
    assert f.prompt_tokens.tolist() == [300, 50] and f.output_tokens.tolist() == [4, 1]
    assert f.arrived_ms.tolist() == pytest.approx([500.0, 100.0])
    assert f.finished_ms.tolist() == pytest.approx([200.0, 0.0])
    # a model whose engine reports its prefill progress needs no replay: none passed
    views, _ = instance_views(CLUSTER, live, now, stale_after_s=2.0)
    assert next(v for v in views if v.instance_id == "s0").finished is None
