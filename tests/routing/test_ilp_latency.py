"""batch-ilp-sfs's latency penalty (paper A's δ·L̂/τ) and calibrated TTFT margin."""

from __future__ import annotations

import numpy as np
import pytest

from routing.policies import make_router
from routing.policies.batch_ilp import latency_penalty
from routing.sfs_margin import ttft_margin
from routing.types import Budget
from schemas import DecisionStatus
from tests.routing.test_policies import context, queries, views


def test_latency_penalty_formula_and_cap() -> None:
    t = np.array([[100.0, 400.0], [np.inf, 50.0]])
    slo = np.array([200.0, 100.0])
    np.testing.assert_allclose(latency_penalty(t, slo, 0.5), [[0.25, 1.0], [5.0, 0.25]])


def test_delta_trades_quality_for_latency() -> None:
    # the two large instances have the same quality; l1 has a much shorter queue.
    # with δ = 0 the ILP is indifferent between them, with δ > 0 it prefers l1
    # once the predicted TTFT on l0 is a large share of the SLO.
    vs = views([0, 0, 20, 1], [8, 8, 8, 8])
    qs = queries([50] * 2, slo_ms=2000.0)
    budget = Budget(window_usd=1.0)
    strong = make_router("batch-ilp-sfs", context(), delta=2.0, robust=False).decide(
        qs, vs, budget, 0.0
    )
    assert all(d.instance_id == "l1" for d in strong)
    # the penalty can outweigh quality: a huge δ leaves the slow large instances
    vs2 = views([0, 0, 40, 40], [8, 8, 8, 8])
    fastest = make_router("batch-ilp-sfs", context(), delta=50.0, robust=False).decide(
        qs, vs2, budget, 0.0
    )
    none = make_router("batch-ilp-sfs", context(), delta=0.0, robust=False).decide(
        qs, vs2, budget, 0.0
    )
    assert all(d.instance_id in ("s0", "m0") for d in fastest)
    assert all(d.instance_id in ("l0", "l1") for d in none)


def test_ttft_margin_makes_near_misses_infeasible() -> None:
    # large instances: 40 ms x 20 residents = 800 ms backlog + 0.6 ms/token x 100 = 860 ms
    vs = views([0, 0, 20, 20], [8, 8, 8, 8])
    qs = queries([100], slo_ms=1000.0)
    budget = Budget(window_usd=1.0)
    plain = make_router("batch-ilp-sfs", context(), delta=0.0, robust=False).decide(
        qs, vs, budget, 0.0
    )
    assert plain[0].instance_id in ("l0", "l1")  # 860 ms <= 1000 ms: the best quality fits
    wary = make_router("batch-ilp-sfs", context(), delta=0.0, ttft_margin=1.25, robust=False)
    d = wary.decide(qs, vs, budget, 0.0)[0]
    assert d.status == DecisionStatus.ROUTED
    assert d.instance_id in ("s0", "m0")  # 1.25 x 860 ms > 1000 ms: a faster instance


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="delta must be a finite number >= 0"):
        make_router("batch-ilp-sfs", context(), delta=-1.0)
    with pytest.raises(ValueError, match="ttft_margin must be a finite number > 0"):
        make_router("batch-ilp-sfs", context(), ttft_margin=0.0)
    with pytest.raises(ValueError, match="delta needs batch-ilp-sfs"):
        make_router("batch-ilp", context(), delta=0.5)


def test_ttft_margin_known_quantile() -> None:
    pred = np.full(101, 100.0)
    obs = np.linspace(50.0, 150.0, 101)  # ratios 0.5 .. 1.5
    assert ttft_margin(pred, obs, 0.9) == pytest.approx(1.4)
    assert ttft_margin(pred[:10], obs[:10], 0.9) == 1.0  # too few pairs: no margin
    pred[0] = np.nan
    assert ttft_margin(pred, obs, 0.5) == pytest.approx(1.005)
    with pytest.raises(ValueError, match="quantile must be in"):
        ttft_margin(pred, obs, 1.0)
    with pytest.raises(ValueError, match="differ in shape"):
        ttft_margin(pred, obs[:5])
