"""A query's ``model`` constrains routing for every policy (``routing.policies.constrained``)."""

from __future__ import annotations

import pytest

from routing.policies import ROUTERS, RouterContext, make_router
from routing.types import Budget
from schemas import ClusterConfig, DecisionFlag, DecisionStatus, Query
from tests.routing import test_policies as fx  # its cluster, fakes and views

PLACED = (DecisionStatus.ROUTED, DecisionStatus.OVER_BUDGET)


def grouped_cluster() -> ClusterConfig:
    raw = fx.cluster().model_dump()
    raw["model_groups"] = {"big": ["medium", "large"]}
    return ClusterConfig.model_validate(raw)


def context() -> RouterContext:
    return RouterContext(grouped_cluster(), fx.FakeQuality(), fx.FakeLength(), ttft=fx.QueueTtft())


def mixed(n: int) -> list[Query]:
    models = [None, "small", "big", "large", "auto"]
    return [
        Query(id=f"q{i}", prompt="x" * (i % 5 + 1), prompt_tokens=50, model=models[i % 5])
        for i in range(n)
    ]


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_constrained_queries_go_only_to_their_models(name: str) -> None:
    qs = mixed(20)
    vs = fx.views([0, 0, 0, 0], [3, 3, 2, 2])
    budget = Budget(window_usd=1.0)
    ds = make_router(name, context()).decide(qs, vs, budget, now=0.0)
    assert [d.query_id for d in ds] == [q.id for q in qs]
    model_of = {v.instance_id: v.model for v in vs}
    allowed = {"small": {"small"}, "big": {"medium", "large"}, "large": {"large"}}
    used: dict[str, int] = {}
    for q, d in zip(qs, ds, strict=True):
        if d.status in PLACED:
            used[str(d.instance_id)] = used.get(str(d.instance_id), 0) + 1
        if q.model in allowed:
            assert DecisionFlag.MODEL_CONSTRAINED in d.flags and d.reason
            if d.status in PLACED:
                assert model_of[str(d.instance_id)] in allowed[q.model]
        else:  # no model, or auto: the policy chooses freely and nothing is flagged
            assert DecisionFlag.MODEL_CONSTRAINED not in d.flags
    for v in vs:  # the parts share the instances' free slots
        assert used.get(v.instance_id, 0) <= v.free_slots
    assert sum(used.values()) == sum(v.free_slots for v in vs)  # 20 queries, 10 slots: all used


@pytest.mark.parametrize("name", ["batch-ilp-sfs", "latency-aware"])
def test_parts_share_the_window_budget(name: str) -> None:
    qs = mixed(10)
    vs = fx.views([0, 0, 0, 0], [10, 10, 10, 10])
    one = make_router(name, context()).decide(qs[:1], vs, Budget(window_usd=1.0), now=0.0)
    unit = one[0].predicted_cost_usd or 0.0
    budget = Budget(window_usd=3.5 * max(unit, 1e-9) * 10)
    ds = make_router(name, context()).decide(qs, vs, budget, now=0.0)
    spend = sum(d.predicted_cost_usd or 0.0 for d in ds if d.status == DecisionStatus.ROUTED)
    assert spend <= budget.window_usd * (1 + 1e-9)


def test_unknown_model_is_rejected_naming_the_models() -> None:
    qs = [Query(id="q0", prompt="x", model="gpt-4o"), Query(id="q1", prompt="y")]
    ds = make_router("batch-ilp-sfs", context()).decide(
        qs, fx.views([0, 0, 0, 0], [1, 1, 1, 1]), Budget(window_usd=1.0), now=0.0
    )
    assert ds[0].status == DecisionStatus.REJECTED and "gpt-4o" in str(ds[0].reason)
    assert "small" in str(ds[0].reason) and "big" in str(ds[0].reason)
    assert ds[1].status == DecisionStatus.ROUTED


def test_a_model_without_a_live_instance_is_deferred() -> None:
    vs = [v for v in fx.views([0, 0, 0, 0], [1, 1, 1, 1]) if v.model != "large"]
    ds = make_router("round-robin", context()).decide(
        [Query(id="q0", prompt="x", model="large")], vs, Budget(window_usd=1.0), now=0.0
    )
    assert ds[0].status == DecisionStatus.DEFERRED and "no live instance" in str(ds[0].reason)


def test_an_unconstrained_window_is_the_policy_unchanged() -> None:
    qs = fx.queries([10, 20, 30])
    vs = fx.views([0, 1, 2, 0], [2, 2, 2, 2])
    wrapped = make_router("batch-ilp", context()).decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    inner = make_router("batch-ilp", context()).inner  # type: ignore[attr-defined]
    plain = inner.decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    assert [(d.instance_id, d.status) for d in wrapped] == [(d.instance_id, d.status) for d in plain]


def test_cluster_groups_are_checked() -> None:
    raw = fx.cluster().model_dump()
    raw["model_groups"] = {"x": ["nope"]}
    with pytest.raises(ValueError, match="unknown"):
        ClusterConfig.model_validate(raw)
    raw["model_groups"] = {"small": ["large"]}
    with pytest.raises(ValueError, match="name of a model"):
        ClusterConfig.model_validate(raw)
    c = grouped_cluster()
    assert c.models_named("big") == ["medium", "large"] and c.models_named("auto") == MODELS3
    with pytest.raises(KeyError, match="not served"):
        c.models_named("gpt-4o")


MODELS3 = ["small", "medium", "large"]
