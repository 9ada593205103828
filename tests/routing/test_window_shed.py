"""routing.window.shed: load shedding by wait (relative to each SLO) and by backlog."""

from __future__ import annotations

import numpy as np
import pytest

from routing.window import (
    SHED_AFTER_SLO,
    SHED_BACKLOG,
    GivenUp,
    HoldReason,
    Shedding,
    WindowSettings,
    shed,
)
from schemas import DecisionStatus


def _shed_ids(out: Shedding[str]) -> list[str]:
    return [g.item for g in out.shed]


def test_off_by_default_keeps_everyone_in_order() -> None:
    s = WindowSettings()
    assert (s.shed_backlog, s.shed_after_slo) == (SHED_BACKLOG, SHED_AFTER_SLO) == (0, 0.0)
    out = shed(["a", "b", "c"], [0.0, 1.0, 2.0], [0.1, 0.1, 0.1], 1e6, s)
    assert out.kept == ["a", "b", "c"] and out.shed == []


def test_a_query_that_waited_its_slo_times_the_factor_is_shed_at_the_limit() -> None:
    s = WindowSettings(shed_after_slo=1.0)
    # waits 3, 2, 1, 0.5 s against SLOs 2, 2.5, 1, 0.4 s: a (over), c (exactly at), d (over)
    out = shed(["a", "b", "c", "d"], [0.0, 1.0, 2.0, 2.5], [2.0, 2.5, 1.0, 0.4], 3.0, s)
    assert out.kept == ["b"] and _shed_ids(out) == ["a", "c", "d"]
    assert all(g.reason == HoldReason.SHED and g.status == DecisionStatus.REJECTED for g in out.shed)
    assert out.shed[0].text == "shed: waited 3 s, past 1 x its TTFT SLO of 2 s"
    half = shed(["a", "b"], [0.0, 0.0], [2.0, 4.0], 1.5, WindowSettings(shed_after_slo=0.5))
    assert half.kept == ["b"] and _shed_ids(half) == ["a"]  # 1.5 s >= 0.5 x 2 s; < 0.5 x 4 s


def test_past_the_backlog_the_earliest_deadlines_go_first() -> None:
    s = WindowSettings(shed_backlog=3)
    # deadlines (sent + SLO): a 10, b 3, c 7, d 3 (tie with b: the older, b, first), e 20
    sent = [0.0, 1.0, 2.0, 2.0, 3.0]
    slo = [10.0, 2.0, 5.0, 1.0, 17.0]
    out = shed(list("abcde"), sent, slo, 3.0, s)
    assert _shed_ids(out) == ["b", "d"]  # in candidate order
    assert out.kept == ["a", "c", "e"]  # candidate order kept (oldest first) for admission
    assert "5 queries waiting in the router, past its backlog limit of 3" in out.shed[0].text
    assert shed(list("abc"), sent[:3], slo[:3], 3.0, s).shed == []  # at the limit: nobody


def test_the_wait_rule_counts_toward_the_backlog_first() -> None:
    s = WindowSettings(shed_backlog=2, shed_after_slo=1.0)
    out = shed(list("abcd"), [0.0, 5.0, 5.5, 5.9], [1.0, 9.0, 3.0, 8.0], 6.0, s)
    # a waited 6 s > 1 s: shed by wait; three left, one over: c has the earliest deadline
    assert _shed_ids(out) == ["a", "c"] and out.kept == ["b", "d"]
    assert "waited 6 s" in out.shed[0].text and "backlog" in out.shed[1].text


def test_a_flood_is_bounded_whatever_its_size() -> None:
    rng = np.random.default_rng(1)
    n = 10_000
    sent = np.sort(rng.uniform(0.0, 1.0, n))
    slo = rng.uniform(0.2, 3.0, n)
    out = shed(list(range(n)), sent, slo, 2.0, WindowSettings(shed_backlog=500, shed_after_slo=1.0))
    assert len(out.kept) == 500 and len(out.kept) + len(out.shed) == n
    kept = np.asarray(out.kept)
    assert np.all(2.0 - sent[kept] < slo[kept])  # none kept past its SLO
    dead = sent + slo
    shed_alive = [g.item for g in out.shed if "backlog" in g.text]
    assert dead[kept].min() >= dead[shed_alive].max()  # the later deadlines were kept
    assert all(isinstance(g, GivenUp) for g in out.shed)


def test_bad_settings_and_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="shed_backlog must be >= 0"):
        WindowSettings(shed_backlog=-1)
    with pytest.raises(ValueError, match="shed_after_slo must be >= 0"):
        WindowSettings(shed_after_slo=float("nan"))
    with pytest.raises(ValueError, match="2 candidates but 1 send times"):
        shed(["a", "b"], [0.0], [1.0, 1.0], 5.0, WindowSettings(shed_after_slo=1.0))
