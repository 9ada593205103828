"""Every registered policy over long-context traffic in the simulator (issue 14, part 1).

Prompts of 5k-130k tokens (a few longer than any model's context) arrive faster than the
instances' KV caches drain, so caches stay nearly full: no exception, exactly one outcome
per query, queries no model can hold rejected, none served beyond its instance's context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from routing.policies import ROUTERS, RouterContext, make_router
from routing.types import Budget, InstanceView
from schemas import Decision, Query
from sim.cluster import SimCluster
from sim.evaluator import REJECTED, EvalConfig, evaluate
from sim.traffic import SloSpec, Workload, build_workload
from tests.routing.test_long_context import MODELS, FakeQuality, cluster
from tests.sim.fakes import routed


def long_workload(n: int = 60, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(5_000, 130_000, n)
    prompts[::15] = 150_000  # beyond every model's context
    arrivals = np.sort(rng.uniform(0, 8.0, n))  # ~2x what the cluster can prefill
    return build_workload(
        arrivals,
        np.tile(np.array([0.5, 0.7, 0.9]), (20, 1)),
        [f"long document {i}" for i in range(20)],
        ["t"] * 20,
        MODELS,
        np.full(20, 1_000),
        np.full((20, 3), np.nan),
        SloSpec.parse("fixed:5000"),
        rng,
        trace_input_tokens=prompts,
        trace_output_tokens=rng.integers(1, 600, n),
        name="long",
    )


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_policy_survives_long_context_traffic(name: str) -> None:
    cfg = cluster()
    w = long_workload()
    router = make_router(name, RouterContext.build(cfg, FakeQuality()))
    res = evaluate(router, SimCluster(cfg, seed=1), w, EvalConfig(window_s=0.5, max_batch=16))
    assert (res.decided == 1).all()  # one final outcome each (evaluate checks it too)
    served = res.served
    assert (res.completed[served] == 1).all() and (res.completed[~served] == 0).all()
    # no query sets max_tokens: its cap is the model's default cut to what the context leaves
    # after the prompt (at least one token), so a prompt fits where it leaves room
    specs = {m.name: m for m in cfg.models}
    too_long = w.prompt_tokens >= max(m.context_tokens() for m in cfg.models)
    assert too_long.sum() == 4
    assert (res.status[too_long] == REJECTED).all()
    for i in np.flatnonzero(served):
        spec, prompt = specs[res.models[res.model[i]]], int(w.prompt_tokens[i])
        assert prompt + spec.default_output_cap_tokens(prompt) <= spec.context_tokens()
    assert served.sum() > 0 and np.isfinite(res.ttft_ms[served]).all()
    assert "engine_rejected" not in res.flags


class _Blind:
    """Routes everything to the first instance, whatever its size (a buggy policy)."""

    name = "blind"

    def decide(
        self, queries: Sequence[Query], instances: Sequence[InstanceView], budget: Budget,
        now: float,
    ) -> list[Decision]:  # fmt: skip
        return [routed(q, instances[0], self.name, now) for q in queries]


def test_an_engine_refuses_what_a_policy_should_not_have_sent() -> None:
    w = long_workload(n=30)
    res = evaluate(_Blind(), SimCluster(cluster()), w, EvalConfig(window_s=0.5))
    big = w.prompt_tokens + 1 > 32_000  # small-0 holds 32,000 tokens
    assert (res.status[big] == REJECTED).all() and res.flags["engine_rejected"] == big.sum()
    assert np.isfinite(res.ttft_ms[~big]).all()
