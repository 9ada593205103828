"""Small fakes for the simulator's tests: a synthetic cluster and two toy routers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from routing.types import Budget, InstanceView
from schemas import ClusterConfig, Decision, DecisionStatus, Query
from sim.traffic import SloSpec, Workload, build_workload


def routed(q: Query, v: InstanceView, policy: str, now: float) -> Decision:
    """The ROUTED decision a toy router makes for ``q`` on ``v``."""
    return Decision(
        query_id=q.id,
        tenant=q.tenant,
        status=DecisionStatus.ROUTED,
        instance_id=v.instance_id,
        model=v.model,
        policy=policy,
        decided_at=now,
    )


STEP = {
    "c0_ms": 5.0,
    "c1_ms_per_token": 0.02,
    "c2_ms_per_ctx_token": 1e-5,
    "c3_ms_per_attn_unit": 1e-7,
}


def small_cluster(n_small: int = 2, n_big: int = 1, cloud: bool = True) -> ClusterConfig:
    big = dict(STEP, c0_ms=15.0, c1_ms_per_token=0.06)
    models = [
        {
            "name": "small",
            "input_usd_per_token": 1e-7,
            "output_usd_per_token": 2e-7,
            "max_concurrency": 32,
            "step_time": STEP,
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 32},
        },
        {
            "name": "big",
            "input_usd_per_token": 1e-6,
            "output_usd_per_token": 2e-6,
            "max_concurrency": 32,
            "gpus_per_instance": 4,
            "step_time": big,
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 32},
        },
    ]
    instances = [{"id": f"small-{k}", "model": "small"} for k in range(n_small)]
    instances += [{"id": f"big-{k}", "model": "big"} for k in range(n_big)]
    if cloud:
        models.append(
            {
                "name": "api",
                "kind": "cloud",
                "input_usd_per_token": 5e-6,
                "output_usd_per_token": 1.5e-5,
                "max_concurrency": 8,
                "rate_limit_rps": 50.0,
            }
        )
        instances.append({"id": "api-0", "model": "api"})
    return ClusterConfig.model_validate({"models": models, "instances": instances})


def toy_workload(
    n: int = 300, rate: float = 20.0, seed: int = 0, slo: str = "fixed:1500"
) -> Workload:
    rng = np.random.default_rng(seed)
    n_data = 200
    hard = rng.random(n_data)
    # small solves easy queries, big medium ones, api nearly everything
    scores = np.stack([(hard < 0.4), (hard < 0.7), (hard < 0.95)], axis=1).astype(float)
    arrivals = np.sort(rng.uniform(0, n / rate, size=n))
    return build_workload(
        arrivals,
        scores,
        [f"text {i}" for i in range(n_data)],
        ["t"] * n_data,
        ["small", "big", "api"],
        rng.integers(50, 800, size=n_data),
        np.full((n_data, 3), np.nan),
        SloSpec.parse(slo),
        rng,
        default_output_tokens=np.array([60.0, 80.0, 100.0]),
        name="toy",
    )


class RoundRobin:
    name = "fake-rr"

    def __init__(self) -> None:
        self._k = 0

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        out = []
        for q in queries:
            v = instances[self._k % len(instances)]
            self._k += 1
            out.append(routed(q, v, self.name, now))
        return out


class PerQueryOracle:
    """Max of score − λ·cost per query, on the workload's own scores (a test oracle)."""

    name = "fake-per-query"

    def __init__(
        self,
        workload: Workload,
        prices: dict[str, float],
        lam: float,
        defer_over_budget: bool = False,
    ):
        self.w = workload
        self.prices = prices
        self.lam = lam
        self.row = {workload.query_id(i): i for i in range(workload.n)}
        self.defer = defer_over_budget

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        out = []
        spent = 0.0
        for q in queries:
            i = self.row[q.id]
            best, best_u, best_c = None, -np.inf, 0.0
            for v in instances:
                j = self.w.models.index(v.model)
                c = self.prices[v.model] * (self.w.prompt_tokens[i] + self.w.output_tokens[i, j])
                u = self.w.scores[i, j] - self.lam * c
                if u > best_u:
                    best, best_u, best_c = v, u, c
            assert best is not None
            st = DecisionStatus.ROUTED
            if self.defer and spent + best_c > budget.window_usd:
                st = DecisionStatus.DEFERRED
            else:
                spent += best_c
            out.append(
                Decision(
                    query_id=q.id,
                    tenant=q.tenant,
                    status=st,
                    instance_id=best.instance_id if st == DecisionStatus.ROUTED else None,
                    model=best.model,
                    policy=self.name,
                    decided_at=now,
                    predicted_cost_usd=best_c,
                )
            )
        return out


class FirstFree:
    """Routes to the first instance with a free slot, else defers (as the real policies do)."""

    name = "fake-first-free"

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        free = {v.instance_id: v.free_slots for v in instances}
        out = []
        for q in queries:
            pick = next((v for v in instances if free[v.instance_id] > 0), None)
            if pick is None:
                out.append(
                    Decision(
                        query_id=q.id,
                        tenant=q.tenant,
                        status=DecisionStatus.DEFERRED,
                        policy=self.name,
                        decided_at=now,
                        reason="no free slot on any instance",
                    )
                )
                continue
            free[pick.instance_id] -= 1
            out.append(routed(q, pick, self.name, now))
        return out
