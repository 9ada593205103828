"""``schemas.messages.decision_stamped_bytes``: the router's routed decision, stamped while
written, is byte for byte the copy-then-serialise it replaces."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    Decision,
    DecisionFlag,
    DecisionStatus,
    WindowStats,
    decision_bytes,
    decision_with,
)
from schemas.messages import decision_stamped_bytes

STATS = WindowStats(
    window_id='batch-ilp-sfs:1.5:q "1" é', n_queries=2, solver="fast", objective=1.0,
    lp_bound=1.0, gap=0.0, budget_usd=1.0, spend_usd=0.5, decide_ms=3.0,
)  # fmt: skip
_TEXT = st.text(st.characters(codec="utf-8"), max_size=20)
_FLOAT = st.floats(min_value=0.0, max_value=1e300, allow_nan=False)


def test_the_stamped_fields_are_the_last_of_a_decision() -> None:
    """The splice writes them after the rest, in this order: so must the model."""
    last = ("predicted_cached_tokens", "decided_at", "budget_period", "reason", "window")
    assert tuple(Decision.model_fields)[-5:] == last


@settings(max_examples=400, deadline=None)
@given(
    status=st.sampled_from([DecisionStatus.ROUTED, DecisionStatus.OVER_BUDGET]),
    flags=st.lists(st.sampled_from(list(DecisionFlag)), max_size=3),
    quality=st.none() | st.floats(min_value=0, max_value=1),
    cost=st.none() | _FLOAT,
    ttft=st.none() | _FLOAT,
    own_cached=st.none() | st.integers(0, 10**12),
    reason=st.none() | _TEXT,
    window=st.booleans(),
    decided_at=_FLOAT,
    period=st.none() | _TEXT,
    cached=st.none() | st.integers(0, 10**12),
)
def test_equal_to_copy_then_serialise(
    status: DecisionStatus,
    flags: list[DecisionFlag],
    quality: float | None,
    cost: float | None,
    ttft: float | None,
    own_cached: int | None,
    reason: str | None,
    window: bool,
    decided_at: float,
    period: str | None,
    cached: int | None,
) -> None:
    d = Decision(
        query_id="q-1", tenant="t", status=status, instance_id="i-0", model="m",
        policy="batch-ilp-sfs", flags=flags, predicted_quality=quality,
        predicted_cost_usd=cost, predicted_ttft_ms=ttft, predicted_cached_tokens=own_cached,
        decided_at=1.0, reason=reason, window=STATS if window else None,
    )  # fmt: skip
    update: dict[str, Any] = {"budget_period": period, "decided_at": decided_at}
    if cached is not None:
        update["predicted_cached_tokens"] = cached
    stamped = decision_with(d, update)
    want = stamped.model_dump_json(exclude_none=True).encode()
    assert decision_bytes(stamped, {}) == want
    memo: dict[Any, bytes] = {}
    got = decision_stamped_bytes(d, decided_at, period, cached, memo)
    assert got == want
    assert decision_stamped_bytes(d, decided_at, period, cached, memo) == want  # from the memo
    assert Decision.model_validate_json(got) == stamped
