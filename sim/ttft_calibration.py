"""Learn the TTFT margin of ``batch-ilp-sfs`` from a simulated run (issue 13, item 3).

A ``RecordingRouter`` wraps any router and keeps, per query, the TTFT its decision
predicted (``Decision.predicted_ttft_ms``, counted from the decision) and when it was
decided. After the run, the realised TTFT of each served query (the evaluator counts it
from arrival) less the time it waited for its decision is what the prediction should
have said; ``routing.sfs_margin.ttft_margin`` turns the pairs into the multiplier
``m = quantile_q(observed / predicted)`` that the policy applies to its SLO check. The
calibration run must use other arrivals (another seed) than the runs it is used in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from routing.sfs_margin import ttft_margin
from routing.types import Budget, FloatArray, InstanceView, Router
from schemas import Decision, Query
from sim.evaluator import EvalResult
from sim.traffic import Workload


@dataclass
class RecordingRouter:
    """A router that remembers each decision's predicted TTFT and decision time."""

    inner: Router
    predicted_ms: dict[str, float] = field(default_factory=dict)
    decided_at: dict[str, float] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or str(self.inner.name)

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        out = self.inner.decide(queries, instances, budget, now)
        for d in out:
            if d.predicted_ttft_ms is not None and d.instance_id is not None:
                self.predicted_ms[d.query_id] = float(d.predicted_ttft_ms)
                self.decided_at[d.query_id] = float(d.decided_at)
        return out

    def pairs(self, result: EvalResult, workload: Workload) -> tuple[FloatArray, FloatArray]:
        """``(predicted, observed)`` TTFT in ms from the decision on, per served query."""
        pred = np.full(workload.n, np.nan)
        obs = np.full(workload.n, np.nan)
        for i in range(workload.n):
            qid = workload.query_id(i)
            if qid in self.predicted_ms and np.isfinite(result.ttft_ms[i]):
                waited_ms = max(0.0, (self.decided_at[qid] - float(workload.arrival_s[i])) * 1e3)
                pred[i] = self.predicted_ms[qid]
                obs[i] = max(0.0, float(result.ttft_ms[i]) - waited_ms)
        return pred, obs


def margin_from_run(
    recorder: RecordingRouter, result: EvalResult, workload: Workload, quantile: float = 0.9
) -> float:
    """The calibrated TTFT multiplier of one recorded run (1.0 with too few pairs)."""
    pred, obs = recorder.pairs(result, workload)
    return ttft_margin(pred, obs, quantile)
