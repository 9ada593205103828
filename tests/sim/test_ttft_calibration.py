"""The TTFT margin learnt from a simulated run (sim/ttft_calibration.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from routing.types import Budget, InstanceView
from schemas import Decision, Query
from sim.cluster import SimCluster
from sim.evaluator import EvalConfig, evaluate
from sim.ttft_calibration import RecordingRouter, margin_from_run
from tests.sim.fakes import RoundRobin, small_cluster, toy_workload


class Predicting:
    """Round robin that claims every query's first token comes 50 ms after its decision."""

    name = "predicting"

    def __init__(self) -> None:
        self.rr = RoundRobin()

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        return [
            d.model_copy(update={"predicted_ttft_ms": 50.0})
            for d in self.rr.decide(queries, instances, budget, now)
        ]


def test_pairs_and_margin_from_a_run() -> None:
    w = toy_workload(n=300, rate=40.0)
    rec = RecordingRouter(Predicting())
    assert rec.name == "predicting"
    res = evaluate(
        rec, SimCluster(small_cluster(), seed=1), w, EvalConfig(window_s=0.1, max_batch=16)
    )
    pred, obs = rec.pairs(res, w)
    served = ~np.isnan(res.ttft_ms)
    assert served.sum() == 300 and (~np.isnan(pred)).sum() == 300
    np.testing.assert_array_equal(pred[served], 50.0)
    # observed counts from the decision: never more than the TTFT counted from arrival
    assert (obs[served] <= res.ttft_ms[served] + 1e-9).all() and (obs[served] >= 0).all()
    assert (res.ttft_ms[served] - obs[served]).max() > 0  # queries did wait for their window
    m = margin_from_run(rec, res, w, quantile=0.9)
    assert m == pytest.approx(float(np.quantile(obs[served] / 50.0, 0.9)))
