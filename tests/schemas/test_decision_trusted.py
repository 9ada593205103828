"""``schemas.decision_trusted``: the validated ``Decision``, without the validation."""

from __future__ import annotations

import pytest

from schemas import (
    Decision,
    DecisionFlag,
    DecisionStatus,
    WindowStats,
    decision_trusted,
    trusted_decisions,
)

STATS = WindowStats(
    window_id="w", n_queries=2, solver="fast", objective=1.0, lp_bound=1.0, gap=0.0,
    budget_usd=1.0, spend_usd=0.5, decide_ms=0.1,
)  # fmt: skip
ROUTED = {
    "query_id": "q1",
    "tenant": "t",
    "status": DecisionStatus.ROUTED,
    "instance_id": "i0",
    "model": "m",
    "policy": "batch-ilp-sfs",
    "flags": [DecisionFlag.LPS_ESTIMATE],
    "predicted_quality": 0.7,
    "predicted_quality_lb": 0.6,
    "predicted_cost_usd": 0.0,
    "predicted_ttft_ms": None,
    "predicted_output_tokens": 12,
    "decided_at": 3.5,
    "reason": None,
    "window": STATS,
}
DEFERRED = {
    "query_id": "q2",
    "tenant": "t",
    "status": DecisionStatus.DEFERRED,
    "policy": "batch-ilp-sfs",
    "decided_at": 3.5,
    "reason": "no free slot",
}


@pytest.mark.parametrize("values", [ROUTED, DEFERRED])
def test_equal_to_the_validated_decision_with_the_same_fields_set_and_json(values: dict) -> None:
    got, want = decision_trusted(dict(values)), Decision(**values)
    assert got == want and got.model_fields_set == want.model_fields_set
    assert got.model_dump_json() == want.model_dump_json()
    assert got.model_dump_json(exclude_unset=True) == want.model_dump_json(exclude_unset=True)
    assert list(got.__dict__) == list(want.__dict__)  # the serialiser's field order


def test_defaults_are_fresh_and_fields_checked() -> None:
    a, b = decision_trusted(dict(DEFERRED)), decision_trusted(dict(DEFERRED))
    a.flags.append(DecisionFlag.DEADLINE)
    assert b.flags == []
    with pytest.raises(ValueError, match="not fields of Decision"):
        decision_trusted({**DEFERRED, "instance": "i0"})
    with pytest.raises(ValueError, match="missing"):
        decision_trusted({k: v for k, v in DEFERRED.items() if k != "tenant"})


@pytest.mark.parametrize("values", [ROUTED, DEFERRED])
def test_trusted_decisions_make_what_decision_trusted_makes(values: dict) -> None:
    make = trusted_decisions(values.keys())
    got, want = make(dict(values)), decision_trusted(dict(values))
    assert got == want and got.model_fields_set == want.model_fields_set
    assert got.model_dump_json() == want.model_dump_json()
    assert list(got.__dict__) == list(want.__dict__)
    # each object its own fields set and its own default lists
    other = make(dict(values))
    assert other.model_fields_set is not got.model_fields_set
    if "flags" not in values:
        got.flags.append(DecisionFlag.DEADLINE)
        assert other.flags == []


def test_trusted_decisions_check_the_fields_once_when_made() -> None:
    with pytest.raises(ValueError, match="not fields of Decision"):
        trusted_decisions([*DEFERRED, "instance"])
    with pytest.raises(ValueError, match="missing"):
        trusted_decisions([k for k in DEFERRED if k != "tenant"])
