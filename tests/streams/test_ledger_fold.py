"""streams.ledger_fold: route messages and results folded into per-tenant ledgers (pure)."""

from __future__ import annotations

import itertools
import random

import pytest

from schemas import ClusterConfig, Decision, DecisionStatus, Query, Result, RoutedQuery
from streams.ledger_fold import LedgerFold

P = "3600s-10"  # the period being rebuilt
OLD = "3600s-9"


def _cluster() -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "small",
                    "input_usd_per_token": 1e-7,
                    "output_usd_per_token": 2e-7,
                    "max_concurrency": 8,
                },
                {
                    "name": "big",
                    "input_usd_per_token": 3e-6,
                    "output_usd_per_token": 1.5e-5,
                    "max_concurrency": 4,
                },
            ],  # fmt: skip
            "instances": [{"id": "s1", "model": "small"}, {"id": "b1", "model": "big"}],
            "tenants": [
                {"tenant": "acme", "budget_usd": 5.0, "period_s": 3600},
                {"tenant": "beta", "budget_usd": 2.0, "period_s": 3600},
            ],
        }
    )


def _query(
    qid: str, tenant: str = "acme", prompt: str = "how far is the moon", max_tokens: int = 64
) -> Query:
    return Query(id=qid, tenant=tenant, prompt=prompt, max_tokens=max_tokens, ttft_slo_ms=5000)


def _routed(q: Query, instance: str, period: str | None = P) -> RoutedQuery:
    d = Decision(
        query_id=q.id,
        tenant=q.tenant,
        status=DecisionStatus.ROUTED,
        instance_id=instance,
        policy="test",
        decided_at=36_000.5,
        budget_period=period,
    )
    return RoutedQuery(query=q, decision=d)


def _result(
    qid: str, cost: float, tenant: str = "acme", instance: str = "s1", error: str | None = None
) -> Result:
    return Result(
        query_id=qid, tenant=tenant, instance_id=instance, model="m", cost_usd=cost,
        error=error, finished_at=36_001.0,
    )  # fmt: skip


def test_settled_and_outstanding_queries_per_tenant() -> None:
    c = _cluster()
    fold = LedgerFold(c, {"acme": P, "beta": P})
    qa, qb, qc = _query("a1"), _query("a2", max_tokens=200), _query("b1", tenant="beta")
    fold.routed(_routed(qa, "s1"), "s1")
    fold.routed(_routed(qb, "b1"), "b1")
    fold.routed(_routed(qc, "b1"), "b1")
    fold.result(_result("a1", 0.0012))
    fold.result(_result("b1", 0.0031, tenant="beta", instance="b1"))
    by = {x.tenant: x for x in fold.ledgers()}
    assert by["acme"].settled_usd == {"a1": 0.0012}
    # no result yet: its worst case on its instance's model, as the router reserved it
    assert by["acme"].reserved_usd == {"a2": c.model("big").max_cost_usd(qb)}
    assert by["beta"].settled_usd == {"b1": 0.0031} and by["beta"].reserved_usd == {}
    assert by["acme"].limit_usd == 5.0 and by["beta"].period_id == P
    assert by["acme"].committed_usd == pytest.approx(0.0012 + c.model("big").max_cost_usd(qb))
    assert fold.counts.routed == 3 and fold.counts.results == 2


def test_other_periods_router_errors_and_orphan_results_are_skipped() -> None:
    fold = LedgerFold(_cluster(), {"acme": P})
    fold.routed(_routed(_query("old"), "s1", period=OLD), "s1")  # reserved in the last period
    fold.routed(_routed(_query("nop"), "s1", period=None), "s1")  # no ledger for it
    fold.routed(_routed(_query("b9", tenant="beta"), "s1"), "s1")  # beta not being rebuilt
    fold.result(_result("old", 0.5))  # settles the last period's ledger, not this one
    fold.result(_result("gone", 0.7))  # routed before the scan started
    assert not fold.result(_result("x", 0.0, instance="", error="not routed"))  # router's own
    (acme,) = fold.ledgers()
    assert acme.settled_usd == {} and acme.reserved_usd == {}
    assert fold.counts.skipped == 3 and fold.counts.results == 2


def test_worker_error_results_settle_at_their_cost() -> None:
    fold = LedgerFold(_cluster(), {"acme": P})
    fold.routed(_routed(_query("e1"), "s1"), "s1")
    fold.result(_result("e1", 0.0, error="backend failed"))
    (acme,) = fold.ledgers()
    assert acme.settled_usd == {"e1": 0.0} and acme.reserved_usd == {}


def test_order_and_repetition_do_not_change_the_ledgers() -> None:
    """Results before their route message, re-deliveries, a re-routed query, a duplicated
    inference with another cost: any order gives the same ledgers (max per query)."""
    c = _cluster()
    q1, q2, q3 = _query("r1"), _query("r2", prompt="x" * 400), _query("r3")
    records: list[tuple[str, object]] = [
        ("route", (_routed(q1, "s1"), "s1")),
        ("route", (_routed(q1, "s1"), "s1")),  # re-delivered
        ("route", (_routed(q2, "s1"), "s1")),
        ("route", (_routed(q2, "b1"), "b1")),  # re-routed to a dearer model
        ("route", (_routed(q3, "b1"), "b1")),
        ("result", _result("r1", 0.001)),
        ("result", _result("r1", 0.0015)),  # duplicated inference
        ("result", _result("r3", 0.02, instance="b1")),
    ]
    expected = None
    rng = random.Random(3)
    orders = [list(p) for p in itertools.islice(itertools.permutations(records), 0, 40)]
    for _ in range(40):
        rng.shuffle(records)
        orders.append(list(records))
    for order in orders:
        fold = LedgerFold(c, {"acme": P})
        for kind, rec in order:
            if kind == "route":
                rq, inst = rec  # type: ignore[misc]
                fold.routed(rq, inst)
            else:
                fold.result(rec)  # type: ignore[arg-type]
        (acme,) = fold.ledgers()
        got = (acme.settled_usd, acme.reserved_usd)
        if expected is None:
            expected = got
        assert got == expected
    assert expected == (
        {"r1": 0.0015, "r3": 0.02},
        {"r2": max(c.model("small").max_cost_usd(q2), c.model("big").max_cost_usd(q2))},
    )


def test_a_tenant_without_a_budget_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tenants \['ghost'\] have no budget"):
        LedgerFold(_cluster(), {"ghost": P})
