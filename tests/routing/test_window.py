"""routing.window: admission, the batch cut, hold or give up, by reason (never by text)."""

from __future__ import annotations

from routing.window import (
    BUDGET_HOLD_S,
    MAX_HOLD_S,
    GivenUp,
    Held,
    HoldReason,
    Lost,
    WindowSettings,
    admit,
    carried,
    hold_or_give_up,
    settle,
)
from schemas import Decision, DecisionFlag, DecisionStatus


def _d(qid: str, status: DecisionStatus, *flags: DecisionFlag, reason: str | None = None,
       instance: str | None = None) -> Decision:  # fmt: skip
    return Decision(query_id=qid, tenant="t", status=status, policy="p", decided_at=0.0,
                    flags=list(flags), reason=reason, instance_id=instance)  # fmt: skip


def test_one_set_of_defaults() -> None:
    s = WindowSettings()
    assert (s.max_batch, s.max_hold_s, s.budget_hold_s) == (1000, MAX_HOLD_S, BUDGET_HOLD_S)
    assert s.hold_limit_s(HoldReason.BUDGET) == 2.0 and s.hold_limit_s(HoldReason.CAPACITY) == 60.0
    assert s.hold_limit_s(HoldReason.BUDGET, blind=True) == 60.0  # blind: wait for Redis


def test_admission_with_every_instance_full_or_none_live_asks_nobody() -> None:
    s = WindowSettings(max_batch=2, max_hold_s=10.0)
    full = admit(["a", "b", "c"], [0.0, 5.0, 9.5], [0, 0], 10.0, s)
    assert full.asked == [] and [h.item for h in full.held] == ["b", "c"]
    assert {h.reason for h in full.held} == {HoldReason.CAPACITY}
    assert [(g.item, g.status) for g in full.given_up] == [("a", DecisionStatus.DEFERRED)]
    assert full.given_up[0].text.startswith("gave up after 10 s: every live instance")
    none = admit(["a"], [9.0], [], 10.0, s, excluded=["i1"])
    assert none.held[0].reason == HoldReason.NO_LIVE_INSTANCE and "i1" in none.held[0].text


def test_the_batch_cut_keeps_the_oldest_and_carries_the_rest_in_order() -> None:
    s = WindowSettings(max_batch=2)
    adm = admit(["a", "b", "c", "d"], [0.0] * 4, [1], 0.0, s)
    assert adm.asked == ["a", "b"] and [h.reason for h in adm.held] == [HoldReason.OVERFLOW] * 2
    plan = settle(adm.asked, [0.0, 0.0],
                  [_d("a", DecisionStatus.DEFERRED), _d("b", DecisionStatus.ROUTED, instance="i")],
                  0.0, s)  # fmt: skip
    assert [q for q, _ in plan.routed] == ["b"]
    assert carried(adm, plan) == ["a", "c", "d"]  # oldest first


def test_the_hold_limit_comes_from_the_flag_not_the_reason_text() -> None:
    s = WindowSettings(max_hold_s=60.0, budget_hold_s=2.0)
    ds = [
        _d("a", DecisionStatus.DEFERRED, DecisionFlag.BUDGET_DEFERRED, reason="no money"),
        _d("b", DecisionStatus.DEFERRED, reason="no free slot or budget left"),  # text lies
        _d("c", DecisionStatus.REJECTED, reason="too long for every model"),
    ]
    plan = settle(["a", "b", "c"], [0.0, 0.0, 9.9], ds, 10.0, s)
    assert [h.item for h in plan.held] == ["b"] and plan.held[0].reason == HoldReason.DEFERRED
    given = {g.item: g for g in plan.given_up}
    assert given["a"].reason == HoldReason.BUDGET and given["a"].text.startswith("gave up after 2 s")
    assert given["c"].status == DecisionStatus.REJECTED and given["c"].text == "too long for every model"


def test_a_lost_reservation_is_held_by_its_kind() -> None:
    s = WindowSettings(max_hold_s=60.0, budget_hold_s=2.0)
    ds = [_d(q, DecisionStatus.ROUTED, instance="i") for q in "ab"]
    lost = {0: Lost(HoldReason.BUDGET, "spent"), 1: Lost(HoldReason.SLOT_LOST, "full")}
    plan = settle(["a", "b"], [0.0, 0.0], ds, 5.0, s, lost)
    assert plan.routed == [] and [h.item for h in plan.held] == ["b"]
    assert [(g.item, g.reason) for g in plan.given_up] == [("a", HoldReason.BUDGET)]


def test_hold_or_give_up_at_the_limit() -> None:
    s = WindowSettings(max_hold_s=1.0)
    assert isinstance(hold_or_give_up("q", 0.0, HoldReason.CAPACITY, "x", 0.999, s), Held)
    assert isinstance(hold_or_give_up("q", 0.0, HoldReason.CAPACITY, "x", 1.0, s), GivenUp)
