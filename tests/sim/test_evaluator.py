"""Evaluator invariants on small synthetic clusters (sim/evaluator.py)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.cluster import SimCluster
from sim.evaluator import DEFERRED, EvalConfig, EvaluationError, evaluate
from sim.traffic import adversarial_order
from tests.sim.fakes import FirstFree, PerQueryOracle, RoundRobin, small_cluster, toy_workload

PRICES = {"small": 1.5e-7, "big": 1.5e-6, "api": 1e-5}


def test_conservation_spend_and_ontime_bound() -> None:
    w = toy_workload(n=300, rate=30.0)
    res = evaluate(
        RoundRobin(),
        SimCluster(small_cluster(), seed=1),
        w,
        EvalConfig(window_s=0.1, max_batch=16, utility_lambda=2000.0),
    )
    assert (res.decided == 1).all()
    assert (res.completed == 1).all()  # every routed query completed exactly once
    assert not np.isnan(res.ttft_ms).any() and (res.ttft_ms > 0).all()
    # spend is the sum of realised costs, recomputed here from prices and tokens
    pin = {"small": 1e-7, "big": 1e-6, "api": 5e-6}
    pout = {"small": 2e-7, "big": 2e-6, "api": 1.5e-5}
    expect = sum(
        pin[w.models[j]] * w.prompt_tokens[i] + pout[w.models[j]] * w.output_tokens[i, j]
        for i, j in enumerate(res.model)
    )
    assert res.spend_usd == pytest.approx(expect)
    assert res.window_spend_usd.sum() == pytest.approx(res.spend_usd)
    assert res.ontime_utility <= res.mean_utility + 1e-12
    assert 0 <= res.slo_attainment <= 1
    assert res.window_size.sum() == w.n and res.window_size.max() <= 16
    s = res.summary()
    assert s["queries"] == 300 and s["routed"] == 300 and s["budget_breaches"] == 0


def test_windows_follow_take_semantics() -> None:
    w = toy_workload(n=200, rate=100.0)
    r1 = evaluate(
        RoundRobin(), SimCluster(small_cluster()), w, EvalConfig(window_s=0.5, max_batch=1000)
    )
    r2 = evaluate(
        RoundRobin(), SimCluster(small_cluster()), w, EvalConfig(window_s=0.5, max_batch=10)
    )
    assert r1.window_size.size < r2.window_size.size
    assert r2.window_size.max() == 10
    # a longer window adds waiting to TTFT
    r0 = evaluate(
        RoundRobin(), SimCluster(small_cluster()), w, EvalConfig(window_s=0.0, max_batch=1)
    )
    assert np.median(r0.ttft_ms) < np.median(r1.ttft_ms)


def test_deterministic_for_a_seed() -> None:
    w = toy_workload(n=150, rate=40.0, seed=2)
    a = evaluate(RoundRobin(), SimCluster(small_cluster(), seed=5), w, EvalConfig())
    b = evaluate(RoundRobin(), SimCluster(small_cluster(), seed=5), w, EvalConfig())
    assert (
        np.array_equal(a.ttft_ms, b.ttft_ms)
        and a.summary()["ontime_utility"] == b.summary()["ontime_utility"]
    )


def test_budget_breaches_and_deferrals_are_counted() -> None:
    w = toy_workload(n=200, rate=20.0)
    cfg = EvalConfig(window_s=0.5, max_batch=20, budget_usd_per_query=2e-4)
    greedy = evaluate(PerQueryOracle(w, PRICES, lam=0.0), SimCluster(small_cluster()), w, cfg)
    assert greedy.breaches and all(b.spend_usd > b.budget_usd for b in greedy.breaches)
    careful = evaluate(
        PerQueryOracle(w, PRICES, lam=0.0, defer_over_budget=True),
        SimCluster(small_cluster()),
        w,
        cfg,
    )
    assert (careful.status == DEFERRED).any()
    assert careful.on_time[careful.status == DEFERRED].sum() == 0
    assert (careful.completed[careful.status == DEFERRED] == 0).all()


def test_adversarial_ordering_increases_per_query_spend_per_window() -> None:
    w = toy_workload(n=400, rate=50.0, seed=4)
    rng = np.random.default_rng(0)
    cost = np.array([PRICES[m] for m in w.models])[None, :] * (
        w.prompt_tokens[:, None] + w.output_tokens
    )
    lam = 300.0
    chosen = cost[np.arange(w.n), np.argmax(w.scores - lam * cost, axis=1)]
    order = adversarial_order(chosen, 20, rng)  # the per-query router's own spend, bunched
    adv = w.reordered(order, name="adv")
    cfg = EvalConfig(window_s=10.0, max_batch=20, budget_usd_per_query=float(chosen.mean() * 1.2))
    rand = evaluate(PerQueryOracle(w, PRICES, lam), SimCluster(small_cluster()), w, cfg)
    bunched = evaluate(PerQueryOracle(adv, PRICES, lam), SimCluster(small_cluster()), adv, cfg)
    assert bunched.spend_usd == pytest.approx(rand.spend_usd, rel=0.15)  # same queries, ~same money
    over = lambda r: float(np.maximum(r.window_spend_usd - r.window_budget_usd, 0).sum())  # noqa: E731
    assert over(bunched) > 2 * over(rand)
    assert bunched.window_spend_usd.max() > rand.window_spend_usd.max()
    assert len(bunched.breaches) >= len(rand.breaches)


class _Broken:
    name = "broken"

    def decide(self, queries, instances, budget, now):  # type: ignore[no-untyped-def]
        return RoundRobin().decide(queries[:-1], instances, budget, now)


def test_contract_breaks_are_reported() -> None:
    w = toy_workload(n=20, rate=10.0)
    with pytest.raises(EvaluationError, match="returned .* decisions for a window of"):
        evaluate(_Broken(), SimCluster(small_cluster()), w, EvalConfig(window_s=1.0, max_batch=4))


def test_full_cluster_holds_queries_like_the_service() -> None:
    w = toy_workload(n=300, rate=3000.0)  # a burst far above the 104 free slots
    res = evaluate(
        FirstFree(), SimCluster(small_cluster()), w, EvalConfig(window_s=0.05, max_batch=64)
    )
    assert (res.decided == 1).all() and (res.status != DEFERRED).all()
    assert (res.completed == 1).all()
    assert res.flags.get("held", 0) > 0
    # held queries wait: the last served started long after the burst
    assert np.nanmax(res.ttft_ms) > 1000
    short = evaluate(
        FirstFree(),
        SimCluster(small_cluster()),
        w,
        EvalConfig(window_s=0.05, max_batch=64, max_hold_s=0.2),
    )
    assert (short.status == DEFERRED).any() and (short.decided == 1).all()
