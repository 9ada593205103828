"""``switchyard replay``'s report (``switchyard batch`` is tested in tests/batch/)."""

from __future__ import annotations

import numpy as np
import pytest

from schemas import Result
from switchyard.commands.replay import ReplayRecord, build_report

CLUSTER = {
    "models": [
        {
            "name": "a",
            "input_usd_per_token": 1e-7,
            "output_usd_per_token": 2e-7,
            "max_concurrency": 16,
            "profile": "llama-2-7b-hf@h100",
        },
        {
            "name": "b",
            "input_usd_per_token": 1e-6,
            "output_usd_per_token": 3e-6,
            "max_concurrency": 16,
            "profile": "llama-2-70b-hf@h100",
        },
    ],  # fmt: skip
    "instances": [{"id": "a-0", "model": "a"}, {"id": "b-0", "model": "b"}],
}


def _result(
    qid: str, model: str, ttft: float | None, cost: float, error: str | None = None, inst: str = "i"
) -> Result:
    return Result(query_id=qid, tenant="default", instance_id=inst, model=model, ttft_ms=ttft,
                  cost_usd=cost, error=error, finished_at=1.0)  # fmt: skip


def test_report_counts_utility_only_on_time() -> None:
    scores = np.array([[0.9, 0.5], [0.2, 0.8], [1.0, 1.0], [0.7, 0.7]])
    recs = [
        ReplayRecord("q0", 0, 1000.0, 0.0, _result("q0", "a", 100.0, 0.01)),  # on time: 0.9
        ReplayRecord("q1", 1, 1000.0, 0.0, _result("q1", "b", 5000.0, 0.02)),  # late: counts 0
        ReplayRecord("q2", 2, 1000.0, 0.0, _result("q2", "a", None, 0.0, error="boom")),
        ReplayRecord("q3", 3, 1000.0, 0.0, None),  # no result
    ]
    rep = build_report(recs, scores, ["a", "b"], budget_usd=1.0)
    assert rep.queries == 4 and rep.results == 3 and rep.missing == 1 and rep.errors == 1
    assert rep.ontime_utility == pytest.approx(0.9 / 4)
    assert rep.mean_utility == pytest.approx((0.9 + 0.8) / 4)
    assert rep.slo_attainment == pytest.approx(0.25)
    assert rep.spend_usd == pytest.approx(0.03)
    assert rep.ttft_p50_ms == pytest.approx(2550.0)
    assert rep.per_instance["i"]["queries"] == 3 and rep.per_instance["i"]["errors"] == 1


def test_a_model_served_under_another_name_is_scored_by_its_quality_as_column() -> None:
    scores = np.array([[0.9, 0.5]])
    recs = [ReplayRecord("q0", 0, 1000.0, 0.0, _result("q0", "tiny-b", 100.0, 0.0))]
    assert build_report(recs, scores, ["a", "b"]).mean_utility == 0.0  # no column: 0
    rep = build_report(recs, scores, ["a", "b"], score_as={"tiny-b": "b"})
    assert rep.mean_utility == pytest.approx(0.5)
