"""Every policy behind one Router: invariants on random windows, the TTFT loop, flags."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.policies import DEFAULT_POLICY, ROUTERS, RouterContext, make_router
from routing.types import Budget, InstanceState, InstanceView, Router
from schemas import ClusterConfig, Decision, DecisionFlag, DecisionStatus, Query

MODELS = ["small", "medium", "large"]
QUALITY = np.array([0.5, 0.7, 0.9])
SPREAD = np.array([0.05, 0.1, 0.4])  # the large model is the least certain
PRICE = np.array([1e-7, 1e-6, 1e-5])


@dataclass
class Estimate:
    mean: np.ndarray
    lower: np.ndarray


class FakeQuality:
    models = MODELS

    def predict(self, texts: Sequence[str]) -> Estimate:
        bump = np.array([(len(t) % 7) / 70 for t in texts])[:, None]
        mean = QUALITY[None, :] + bump
        return Estimate(mean, mean - SPREAD[None, :])


class FakeLength:
    models = MODELS

    def predict(self, texts: Sequence[str], prompt_tokens: np.ndarray) -> np.ndarray:
        return np.tile(np.array([100.0, 150.0, 200.0]), (len(texts), 1))


class QueueTtft:
    """A backlog of 40 ms per resident, then prefill at ``ms_per_token`` in FCFS order."""

    ms_per_token = {"small": 0.05, "medium": 0.2, "large": 0.6}

    def _backlog(self, view: InstanceView) -> float:
        return 40.0 * (view.state.n if view.state is not None else 4)

    def standalone_ms(
        self, view: InstanceView, prompt: np.ndarray, out: np.ndarray, prefix: object = None
    ) -> np.ndarray:
        return self._backlog(view) + self.ms_per_token[view.model] * prompt.astype(float)

    def in_order_ms(
        self,
        view: InstanceView,
        prompt: np.ndarray,
        out: np.ndarray,
        prefix: object = None,
        over_ms: np.ndarray | None = None,
    ) -> np.ndarray:
        return self._backlog(view) + np.cumsum(self.ms_per_token[view.model] * prompt.astype(float))

    def is_estimate(self, view: InstanceView) -> bool:
        return view.state is None


def cluster() -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {"name": m, "input_usd_per_token": float(p), "output_usd_per_token": float(2 * p)}
                for m, p in zip(MODELS, PRICE, strict=True)
            ],
            "instances": [
                {"id": "s0", "model": "small"},
                {"id": "m0", "model": "medium"},
                {"id": "l0", "model": "large"},
                {"id": "l1", "model": "large"},
            ],
        }
    )


def context() -> RouterContext:
    return RouterContext(cluster(), FakeQuality(), FakeLength(), ttft=QueueTtft())


def state(residents: int) -> InstanceState:
    z = np.zeros(residents, dtype=np.int64)
    return InstanceState(z + 100, z + 100, z + 5, z + 50)


def views(
    residents: Sequence[int], slots: Sequence[int], stateless: int = -1
) -> list[InstanceView]:
    ids = [("s0", "small"), ("m0", "medium"), ("l0", "large"), ("l1", "large")]
    return [
        InstanceView(iid, model, None if j == stateless else state(r), free_slots=s)
        for j, ((iid, model), r, s) in enumerate(zip(ids, residents, slots, strict=True))
    ]


def queries(
    prompts: Sequence[int], slo_ms: float | Sequence[float] = 2000.0, tenant: str = "default"
) -> list[Query]:
    slos = [slo_ms] * len(prompts) if isinstance(slo_ms, float | int) else list(slo_ms)
    return [
        Query(id=f"q{i}", prompt="x" * (i % 11 + 1), prompt_tokens=p, ttft_slo_ms=s, tenant=tenant)
        for i, (p, s) in enumerate(zip(prompts, slos, strict=True))
    ]


def check_invariants(
    qs: list[Query], vs: list[InstanceView], budget: Budget, ds: list, name: str
) -> None:
    assert [d.query_id for d in ds] == [q.id for q in qs]
    assert all(d.policy == name for d in ds)
    routed = [d for d in ds if d.status in (DecisionStatus.ROUTED, DecisionStatus.OVER_BUDGET)]
    for v in vs:
        assert sum(d.instance_id == v.instance_id for d in routed) <= v.free_slots
    spend = sum(d.predicted_cost_usd or 0.0 for d in ds if d.status == DecisionStatus.ROUTED)
    assert spend <= budget.window_usd * (1 + 1e-9) + 1e-15
    for d in ds:
        # built unvalidated (schemas.decision_trusted): what validation would have made
        given = {k: getattr(d, k) for k in d.model_fields_set}
        checked = Decision.model_validate(given)
        assert checked == d and checked.model_fields_set == d.model_fields_set
        assert checked.model_dump_json() == d.model_dump_json()
        if d.status == DecisionStatus.ROUTED:
            assert d.instance_id is not None and d.predicted_quality is not None
            assert d.window is not None and d.window.n_queries == len(qs)
        else:
            assert d.reason


@pytest.mark.parametrize("name", sorted(ROUTERS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.integers(1, 4000), min_size=0, max_size=12),
    residents=st.lists(st.integers(0, 8), min_size=4, max_size=4),
    slots=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    budget_frac=st.sampled_from([0.0, 0.3, 1.0, 10.0]),
)
def test_every_router_decides_each_query_once_within_budget_and_slots(
    name: str, prompts: list[int], residents: list[int], slots: list[int], budget_frac: float
) -> None:
    router = make_router(name, context())
    assert isinstance(router, Router)
    qs = queries(prompts, 1000.0)
    vs = views(residents, slots)
    typical = float(sum(prompts)) * 1e-6 + len(prompts) * 1e-4
    budget = Budget(window_usd=budget_frac * typical)
    ds = router.decide(qs, vs, budget, now=100.0)
    check_invariants(qs, vs, budget, ds, name)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.integers(1, 6000), min_size=1, max_size=16),
    residents=st.lists(st.integers(0, 20), min_size=4, max_size=4),
    slo=st.sampled_from([300.0, 800.0, 2000.0]),
    rounds=st.integers(0, 3),
)
def test_ttft_loop_ends_with_sfs_satisfied_or_flagged(
    prompts: list[int], residents: list[int], slo: float, rounds: int
) -> None:
    router = make_router("batch-ilp-sfs", context(), max_ttft_rounds=rounds)
    qs = queries(prompts, slo)
    vs = views(residents, [8, 8, 8, 8])
    ds = router.decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    check_invariants(qs, vs, Budget(window_usd=1.0), ds, "batch-ilp-sfs")
    ttft = QueueTtft()
    by_id = {q.id: q for q in qs}
    for v in vs:
        mine = [d for d in ds if d.instance_id == v.instance_id]  # arrival order kept
        if not mine:
            continue
        prompt = np.array([by_id[d.query_id].prompt_tokens for d in mine])
        t = ttft.in_order_ms(v, prompt, prompt)
        for d, tt in zip(mine, t, strict=True):
            assert d.predicted_ttft_ms == pytest.approx(tt)
            assert tt <= by_id[d.query_id].ttft_slo_ms or DecisionFlag.SLO_INFEASIBLE in d.flags
    # budget is ample: a query is deferred only when the SLO cuts closed its slots
    assert all("slot" in (d.reason or "") for d in ds if d.status != DecisionStatus.ROUTED)


def test_impossible_slo_goes_to_lowest_ttft_instance_flagged() -> None:
    for name in ("batch-ilp-sfs", "latency-aware", "per-query-robust"):
        router = make_router(name, context())
        qs = queries([1000], 1.0)  # 1 ms: nobody can
        ds = router.decide(qs, views([5, 0, 5, 5], [4, 4, 4, 4]), Budget(window_usd=1.0), now=0.0)
        assert ds[0].status == DecisionStatus.ROUTED
        assert ds[0].instance_id == "m0"  # empty medium: 40*0 + 0.2*1000 = 200 ms, the lowest
        assert DecisionFlag.SLO_INFEASIBLE in ds[0].flags, name


def test_time_already_waited_counts_against_the_slo() -> None:
    """A query created 1.9 s ago with a 2 s SLO has 100 ms left: only an empty medium
    instance (200 ms) could have made it earlier, so it is now flagged infeasible."""
    for name in ("batch-ilp-sfs", "latency-aware", "per-query-robust"):
        router = make_router(name, context())
        fresh = [q.model_copy(update={"created_at": 100.0}) for q in queries([1000], 2000.0)]
        vs = views([5, 0, 5, 5], [4, 4, 4, 4])
        ok = router.decide(fresh, vs, Budget(window_usd=1.0), now=100.05)
        assert DecisionFlag.SLO_INFEASIBLE not in ok[0].flags, name
        late = router.decide(fresh, vs, Budget(window_usd=1.0), now=101.9)
        assert DecisionFlag.SLO_INFEASIBLE in late[0].flags, name


def test_sfs_policies_avoid_an_overloaded_instance() -> None:
    qs = queries([2000] * 3, 900.0)
    vs = views([0, 0, 30, 0], [4, 4, 4, 1])  # l0 has 30 residents: 1.2 s backlog
    for name in ("batch-ilp-sfs", "latency-aware", "per-query-robust"):
        ds = make_router(name, context()).decide(qs, vs, Budget(window_usd=1.0), now=0.0)
        assert all(d.instance_id != "l0" for d in ds), name
        assert all(DecisionFlag.SLO_INFEASIBLE not in d.flags for d in ds)
    blind = make_router("batch-ilp", context(), robust=False).decide(
        qs, vs, Budget(window_usd=1.0), now=0.0
    )
    assert sum(d.instance_id == "l0" for d in blind) >= 2  # latency-blind: best mean quality


def test_batch_ilp_robust_prefers_certain_models_and_reports_window_figures() -> None:
    qs = queries([100] * 6)
    vs = views([0, 0, 0, 0], [6, 6, 6, 6])
    ds = make_router("batch-ilp", context()).decide(qs, vs, Budget(window_usd=1.0), now=5.0)
    # lower bounds: small .45, medium .6, large .5 -> medium
    assert {d.model for d in ds} == {"medium"}
    w = ds[0].window
    assert w is not None and w.gap <= 1e-3 and w.lp_bound >= w.objective - 1e-12
    assert w.spend_usd == pytest.approx(sum(d.predicted_cost_usd or 0 for d in ds))
    mean = make_router("latency-agnostic", context()).decide(
        qs, vs, Budget(window_usd=1.0), now=5.0
    )
    assert {d.model for d in mean} == {"large"}


def test_binding_budget_reports_its_dual_and_never_overspends() -> None:
    qs = queries([500] * 20)
    vs = views([0, 0, 0, 0], [20, 20, 20, 20])
    router = make_router("batch-ilp", context(), robust=False)
    cost_large = 500 * 1e-5 + 200 * 2e-5
    budget = Budget(window_usd=5 * cost_large)
    ds = router.decide(qs, vs, budget, now=0.0)
    check_invariants(qs, vs, budget, ds, "batch-ilp")
    assert all(d.status == DecisionStatus.ROUTED for d in ds)
    assert ds[0].window is not None and ds[0].window.budget_dual > 0
    assert 1 <= sum(d.model == "large" for d in ds) <= 5


def test_unaffordable_window_defers_or_goes_over_budget_when_allowed() -> None:
    qs = queries([500] * 4)
    vs = views([0, 0, 0, 0], [4, 4, 4, 4])
    for name in sorted(ROUTERS):
        ds = make_router(name, context()).decide(qs, vs, Budget(window_usd=0.0), now=0.0)
        assert all(d.status == DecisionStatus.DEFERRED for d in ds), name
        assert all("budget" in (d.reason or "") for d in ds), name
        over = make_router(name, context()).decide(
            qs, vs, Budget(window_usd=0.0, allow_overspend=True), now=0.0
        )
        assert all(d.status == DecisionStatus.OVER_BUDGET for d in over), name
        assert all(d.model == "small" for d in over), name  # the cheapest instance


def test_tenant_remaining_budget_binds() -> None:
    qs = queries([500] * 4, tenant="acme") + [
        Query(id="b1", prompt="y", prompt_tokens=500, tenant="other")
    ]
    vs = views([0, 0, 0, 0], [5, 5, 5, 5])
    budget = Budget(window_usd=1.0, tenant_remaining_usd={"acme": 0.0})
    for name in sorted(ROUTERS):
        ds = make_router(name, context()).decide(qs, vs, budget, now=0.0)
        assert [d.status for d in ds[:4]] == [DecisionStatus.DEFERRED] * 4, name
        assert ds[4].status == DecisionStatus.ROUTED, name


def test_capacity_is_a_hard_limit() -> None:
    qs = queries([100] * 5)
    ds = make_router(DEFAULT_POLICY, context()).decide(
        qs, views([0] * 4, [1, 1, 0, 1]), Budget(window_usd=1.0), now=0.0
    )
    assert sum(d.status == DecisionStatus.ROUTED for d in ds) == 3
    assert all("slot" in (d.reason or "") for d in ds if d.status == DecisionStatus.DEFERRED)


def test_stateless_and_stale_instances_are_flagged() -> None:
    vs = views([0, 0, 0, 0], [4, 4, 4, 4], stateless=1)
    vs[3] = InstanceView("l1", "large", None, free_slots=4, stale=True)
    qs = queries([100] * 8)
    ds = make_router("round-robin", context()).decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    flags = {d.instance_id: d.flags for d in ds}
    assert DecisionFlag.LPS_ESTIMATE in flags["m0"]
    assert DecisionFlag.STALE_STATE in flags["l1"]
    assert flags["s0"] == []


def test_round_robin_cycles_and_shortest_queue_balances() -> None:
    qs = queries([100] * 8)
    vs = views([0, 3, 1, 2], [8, 8, 8, 8])
    rr = make_router("round-robin", context()).decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    assert [d.instance_id for d in rr[:4]] == ["s0", "m0", "l0", "l1"]
    sq = make_router("shortest-queue", context()).decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    assert sq[0].instance_id == "s0"
    loads = {"s0": 0, "m0": 3, "l0": 1, "l1": 2}
    for d in sq:
        loads[d.instance_id] += 1
    assert max(loads.values()) - min(loads.values()) <= 1


def test_no_instances_rejects_and_unknown_policy_is_named() -> None:
    ds = make_router(DEFAULT_POLICY, context()).decide(
        queries([1]), [], Budget(window_usd=1.0), now=0.0
    )
    assert ds[0].status == DecisionStatus.REJECTED
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_router("fastest", context())
    with pytest.raises(ValueError, match="bad options"):
        make_router("round-robin", context(), delta=1.0)
    assert make_router("latency-aware", context(), robust=True).inner.robust  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="delta must be"):
        make_router("latency-aware", context(), delta=float("nan"))


def test_predictor_missing_a_cluster_model_is_a_clear_error() -> None:
    class Two(FakeQuality):
        models = ["small", "medium"]

    with pytest.raises(ValueError, match=r"no column for models \['large'\]"):
        RouterContext(cluster(), Two())


def test_a_model_reads_the_predictor_column_named_by_quality_as() -> None:
    """A cluster model the predictor never saw reads a stand-in's column (``quality_as``):
    the same decisions as the cluster that names the stand-in itself."""
    from routing.policies.common import prepare

    spec = cluster().model_dump(mode="json")
    spec["models"][2].update(name="large-ft", quality_as="large")
    spec["instances"] = [dict(i, model="large-ft") if i["model"] == "large" else i
                         for i in spec["instances"]]  # fmt: skip
    aliased = ClusterConfig.model_validate(spec)
    ctx = RouterContext(aliased, FakeQuality(), FakeLength(), ttft=QueueTtft())
    vs = [InstanceView(v.instance_id, "large-ft" if v.model == "large" else v.model, v.state,
                       free_slots=v.free_slots) for v in views([0, 0, 0, 0], [4, 4, 4, 4])]  # fmt: skip
    qs = queries([100, 200, 300])
    win, plain = prepare(ctx, qs, vs, 0.0), prepare(context(), qs, views([0, 0, 0, 0], [4] * 4), 0.0)
    np.testing.assert_array_equal(win.quality_mean, plain.quality_mean)
    np.testing.assert_array_equal(win.output_tokens, plain.output_tokens)
    assert win.usable.all()
    spec["models"][2]["quality_as"] = "huge"
    with pytest.raises(ValueError, match=r"no column for models \['large-ft'\].*quality_as"):
        RouterContext(ClusterConfig.model_validate(spec), FakeQuality())


def test_build_takes_a_named_profile_from_the_profiles_it_is_given() -> None:
    from routing.profiles import Profiles
    from routing.steptime import StepTimeModel

    raw = cluster().model_dump()
    raw["models"][0]["profile"] = "toy@cpu"
    named = ClusterConfig.model_validate(raw)
    coef = {"c0_ms": 3.0, "c1_ms_per_token": 0.01, "c2_ms_per_ctx_token": 1e-5,
            "c3_ms_per_attn_unit": 1e-7}  # fmt: skip
    book = Profiles.from_document({"profiles": {"toy@cpu": {"coefficients": coef}}})
    ctx = RouterContext.build(named, FakeQuality(), profiles=book)
    assert ctx.step_time["small"] == StepTimeModel(3.0, 0.01, 1e-5, 1e-7)
    assert "medium" not in ctx.step_time  # no profile, no coefficients: nothing to fill
    with pytest.raises(ValueError, match="'small' names step-time profile 'toy@cpu'"):
        RouterContext.build(named, FakeQuality())  # routing/ reads no profiles file itself


def test_default_policy_with_real_sfs_estimator() -> None:
    pytest.importorskip("routing.sfs")
    from routing.steptime import StepTimeModel

    step = StepTimeModel(5.0, 0.02, 1e-4, 1e-6)
    ctx = RouterContext.build(
        cluster(), FakeQuality(), FakeLength(), step_time={m: step for m in MODELS}
    )
    qs = queries([300, 3000, 800, 50], 400.0)
    vs = views([2, 10, 0, 4], [4, 4, 4, 4], stateless=3)
    ds = make_router(DEFAULT_POLICY, ctx).decide(qs, vs, Budget(window_usd=1.0), now=1.0)
    assert len(ds) == 4
    for d in ds:
        assert d.status == DecisionStatus.ROUTED
        assert d.predicted_ttft_ms is not None
        assert (
            d.predicted_ttft_ms <= 400.0
            or DecisionFlag.SLO_INFEASIBLE in d.flags
            or DecisionFlag.LPS_ESTIMATE in d.flags
        )


def test_nan_quality_from_a_predictor_is_a_clear_error() -> None:
    class Broken(FakeQuality):
        def predict(self, texts: Sequence[str]) -> Estimate:
            est = super().predict(texts)
            est.mean[0, 1] = np.nan
            return est

    ctx = RouterContext(cluster(), Broken(), FakeLength(), ttft=QueueTtft())
    with pytest.raises(ValueError, match="NaN or inf quality"):
        make_router(DEFAULT_POLICY, ctx).decide(
            queries([10, 20]), views([0] * 4, [2] * 4), Budget(window_usd=1.0), now=0.0
        )
    with pytest.raises(ValueError, match="window_usd must be a finite number"):
        Budget(window_usd=float("nan"))
    with pytest.raises(ValueError, match="lam_per_usd must be"):
        RouterContext(cluster(), FakeQuality(), lam_per_usd=-1.0)


def test_deadline_returns_a_feasible_flagged_window() -> None:
    qs = queries([500] * 30)
    vs = views([0, 0, 0, 0], [10, 10, 10, 10])
    cost_large = 500 * 1e-5 + 200 * 2e-5
    budget = Budget(window_usd=5 * cost_large)
    router = make_router("batch-ilp", context(), robust=False, deadline_ms=1e-6)
    ds = router.decide(qs, vs, budget, now=0.0)
    check_invariants(qs, vs, budget, ds, "batch-ilp")
    assert all(DecisionFlag.DEADLINE in d.flags for d in ds)
    # 10 small + 10 medium + 4 large is the most the budget affords, as without a deadline
    assert sum(d.status == DecisionStatus.ROUTED for d in ds) == 24
    full = make_router("batch-ilp", context(), robust=False).decide(qs, vs, budget, now=0.0)
    assert sum(d.status == DecisionStatus.ROUTED for d in full) == 24


@pytest.mark.parametrize("method", ["scip", "highs", "fast+scip"])
def test_exact_methods_behind_the_batch_policy_report_the_budget_dual(method: str) -> None:
    qs = queries([500] * 12)
    vs = views([0, 0, 0, 0], [12, 12, 12, 12])
    budget = Budget(window_usd=3 * (500 * 1e-5 + 200 * 2e-5))
    ds = make_router("batch-ilp", context(), robust=False, method=method).decide(
        qs, vs, budget, now=0.0
    )
    check_invariants(qs, vs, budget, ds, "batch-ilp")
    fast = make_router("batch-ilp", context(), robust=False).decide(qs, vs, budget, now=0.0)
    assert ds[0].window is not None and fast[0].window is not None
    assert ds[0].window.objective >= fast[0].window.objective - 1e-9
    assert ds[0].window.budget_dual > 0


def test_instance_of_an_unknown_model_is_never_used() -> None:
    vs = views([0, 0, 0, 0], [4, 4, 4, 4])
    vs.append(InstanceView("x0", "mystery", state(0), free_slots=10))
    qs = queries([100] * 6)
    for name in sorted(ROUTERS):
        ds = make_router(name, context()).decide(qs, vs, Budget(window_usd=1.0), now=0.0)
        assert all(d.instance_id != "x0" for d in ds), name
        assert all(d.status == DecisionStatus.ROUTED for d in ds), name


def test_policy_options_parse_resolve_and_name_mistakes() -> None:
    from routing.policies import effective_options, parse_options

    opts = parse_options(["delta=0.1", "robust=false", "method=greedy", "max-ttft-rounds=2",
                          "deadline_ms=none"])  # fmt: skip
    assert opts == {"delta": 0.1, "robust": False, "method": "greedy", "max_ttft_rounds": 2,
                    "deadline_ms": None}  # fmt: skip
    for bad in (["delta"], ["=1"], ["2x=1"]):
        with pytest.raises(ValueError, match="is not key=value"):
            parse_options(bad)
    with pytest.raises(ValueError, match="not finite"):
        parse_options(["delta=nan"])
    eff = effective_options("batch-ilp-sfs", gap_tol=0.01)
    assert eff["gap_tol"] == 0.01 and eff["delta"] == 0.05 and eff["method"] == "fast"
    assert effective_options("round-robin") == {}
    with pytest.raises(ValueError, match=r"no option deltaa; it has .*delta"):
        effective_options("latency-aware", deltaa=0.1)
    # the options reach the policy
    assert make_router("latency-aware", context(), **parse_options(["delta=0.3"])).inner.delta == 0.3  # type: ignore[attr-defined]


def test_the_dispatch_delay_is_in_every_predicted_ttft_and_the_slo_check() -> None:
    from dataclasses import replace

    from routing.steptime import StepTimeModel

    step = StepTimeModel(5.0, 0.02, 1e-4, 1e-6)
    ctx = RouterContext.build(
        cluster(), FakeQuality(), FakeLength(), step_time={m: step for m in MODELS}
    )
    vs = views([2, 10, 0, 4], [4, 4, 4, 4])
    late = [replace(v, dispatch_ms=250.0) for v in vs]
    prompts, outs = np.array([300, 800]), np.array([20, 20])
    for v, w in zip(vs, late, strict=True):
        for f in (ctx.ttft_model.standalone_ms, ctx.ttft_model.in_order_ms):
            assert f(w, prompts, outs) == pytest.approx(f(v, prompts, outs) + 250.0)
    qs = queries([300, 800], 400.0)
    on_time = make_router(DEFAULT_POLICY, ctx).decide(qs, vs, Budget(window_usd=1.0), now=1.0)
    assert all(DecisionFlag.SLO_INFEASIBLE not in d.flags for d in on_time)
    # 450 ms of dispatch: no instance can start a token within the 400 ms SLO any more
    slow = [replace(v, dispatch_ms=450.0) for v in vs]
    ds = make_router(DEFAULT_POLICY, ctx).decide(qs, slow, Budget(window_usd=1.0), now=1.0)
    for d in ds:
        assert d.predicted_ttft_ms is not None and d.predicted_ttft_ms >= 450.0
        assert DecisionFlag.SLO_INFEASIBLE in d.flags


def test_an_engine_without_prefill_progress_is_caught_up_to_decision_time() -> None:
    """``prefill_progress: inferred`` (a real vLLM): a resident without its first token has
    been prefilling since it arrived (``InstanceView.waited_ms``); "reported": the snapshot
    is taken as current."""
    from dataclasses import replace

    from routing.sfs import catch_up, later_arrivals, standalone_ttft_ms
    from routing.steptime import StepTimeModel

    step = StepTimeModel(5.0, 0.1, 0.0, 0.0)
    base = cluster()
    inferred = base.model_copy(
        update={
            "models": [m.model_copy(update={"prefill_progress": "inferred"}) for m in base.models]
        }
    )
    waiting = InstanceState(np.array([2000]), np.array([0]), np.array([0]), np.array([50]))
    v = InstanceView("s0", "small", waiting, free_slots=4, waited_ms=np.array([150.0]))
    prompts, outs = np.array([300]), np.array([20])
    reported = RouterContext.build(base, FakeQuality(), FakeLength(), step_time={"small": step})
    caught = RouterContext.build(inferred, FakeQuality(), FakeLength(), step_time={"small": step})
    plain = reported.ttft_model.standalone_ms(v, prompts, outs)[0]
    assert plain == pytest.approx(standalone_ttft_ms(waiting, prompts, step, base.models[0].scheduler)[0])
    st, delay = catch_up(waiting, np.array([150.0]), step, inferred.models[0].scheduler)
    want = standalone_ttft_ms(st, prompts, step, inferred.models[0].scheduler, start_delay_ms=delay)
    # alone, a candidate also pays for the requests expected after it (one 2,000-token
    # arrival in the snapshot's last second) in its last prefill step
    later = later_arrivals(waiting, np.array([150.0]))
    assert later.rate_per_ms == pytest.approx(1e-3) and later.prompt_tokens == 2000.0
    sched = inferred.models[0].scheduler
    priced = standalone_ttft_ms(st, prompts, step, sched, start_delay_ms=delay, later=later)
    assert priced[0] > want[0]
    assert caught.ttft_model.standalone_ms(v, prompts, outs)[0] == pytest.approx(priced[0])
    assert want[0] < plain - 100.0  # 150 ms of the 2,000-token prefill are already done
    assert caught.ttft_model.in_order_ms(v, prompts, outs)[0] < reported.ttft_model.in_order_ms(
        v, prompts, outs
    )[0]
    # no ages known: nothing to catch up
    assert caught.ttft_model.standalone_ms(replace(v, waited_ms=None), prompts, outs)[0] == (
        pytest.approx(plain)
    )
    # a request that left 20 ms ago after 200 ms at the engine took the steps before the
    # resident's: the view's recently finished requests reach the catch-up
    from routing.types import RecentFinished

    done = RecentFinished.of([(1000, 2, 200.0, 20.0)])
    st, delay = catch_up(waiting, np.array([150.0]), step, inferred.models[0].scheduler, done)
    more = later_arrivals(waiting, np.array([150.0]), done)
    after = standalone_ttft_ms(st, prompts, step, sched, start_delay_ms=delay, later=more)
    assert after[0] > priced[0] + 10.0
    assert caught.ttft_model.standalone_ms(replace(v, finished=done), prompts, outs)[0] == (
        pytest.approx(after[0])
    )


def test_an_inferred_engine_conditions_decoding_residents_lengths_on_the_finished_ones() -> None:
    """``prefill_progress: inferred``: after the catch-up, a decoding resident's output length
    is the mean of the recently finished lengths above what it decoded
    (``routing.sfs.with_conditional_lengths``); a "reported" model's view carries no
    finished requests and keeps its predictions."""
    from dataclasses import replace

    from routing.sfs import catch_up, estimate_ttft_ms, with_conditional_lengths
    from routing.steptime import StepTimeModel
    from routing.types import RecentFinished

    step = StepTimeModel(5.0, 0.1, 0.001, 0.0)
    base = cluster()
    inferred = base.model_copy(
        update={
            "models": [
                m.model_copy(
                    update={
                        "prefill_progress": "inferred",
                        "scheduler": m.scheduler.model_copy(update={"max_num_batched_tokens": 256}),
                    }
                )
                for m in base.models
            ]
        }
    )
    sched = inferred.models[0].scheduler
    # one resident decoding (40 of a predicted 42 tokens), one waiting for its first token
    state = InstanceState(
        np.array([1500, 2000]), np.array([1500, 0]), np.array([40, 0]), np.array([42, 50])
    )
    waited = np.array([900.0, 30.0])
    fin = RecentFinished.of(
        [(64, n, 900.0, 50.0) for n in (10, 20, 30, 40, 60, 80, 120, 200, 250)]
    )
    v = InstanceView("s0", "small", state, free_slots=4, waited_ms=waited, finished=fin)
    prompts, outs = np.array([3000]), np.array([20])
    ctx = RouterContext.build(inferred, FakeQuality(), FakeLength(), step_time={"small": step})
    st, delay = catch_up(state, waited, step, sched, fin)
    cond = with_conditional_lengths(st, fin)
    # d=40: 60, 80, 120, 200, 250 -> 142 tokens, not the 42 it was routed with
    assert cond.predicted_output_tokens[0] == 142
    want = estimate_ttft_ms(cond, prompts, step, sched, start_delay_ms=delay, output_tokens=outs)
    flat = estimate_ttft_ms(st, prompts, step, sched, start_delay_ms=delay, output_tokens=outs)
    assert want[0] > flat[0] + 1.0  # the resident now decodes beside the whole prefill
    assert ctx.ttft_model.in_order_ms(v, prompts, outs)[0] == pytest.approx(want[0])
    # no finished requests known: the routed predictions stand
    assert ctx.ttft_model.in_order_ms(replace(v, finished=None), prompts, outs)[0] == (
        pytest.approx(
            estimate_ttft_ms(
                *catch_up(state, waited, step, sched)[:1], prompts, step, sched,
                start_delay_ms=catch_up(state, waited, step, sched)[1], output_tokens=outs,
            )[0]
        )
    )  # fmt: skip


def test_ttft_rounds_warm_start_from_the_last_solves_capacity_multipliers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round of TTFT cuts starts its solve from the capacity multipliers of the last
    solve that computed some (within a window, and into the next window on the same
    instances); a window on other instances starts cold."""
    import routing.policies.batch_ilp as batch_ilp

    calls: list[tuple[np.ndarray | None, object]] = []
    real = batch_ilp.solve

    def spy(problem: object, method: object, **kw: object) -> object:
        sol = real(problem, method, **kw)  # type: ignore[arg-type]
        warm = kw["warm"]
        calls.append((None if warm is None else warm.v, sol))  # type: ignore[attr-defined]
        return sol

    monkeypatch.setattr(batch_ilp, "solve", spy)
    router = make_router("batch-ilp-sfs", context())
    # 60 queries, 2,000-token prompts on a tight SLO: the large instances' TTFT and slots
    # bind, so the rounds' solves run the dual (not only the μ = v = 0 check)
    qs = queries([2000] * 60, 1500.0)
    vs = views([2, 2, 2, 2], [30, 30, 12, 12])

    router.decide(qs, vs, Budget(window_usd=1.0), now=0.0)
    first = len(calls)
    assert calls[0][0] is None  # the first window starts cold
    warmed, last = 0, None
    for v, sol in calls:
        if last is not None:  # after a solve that computed multipliers: warm from them
            assert v is not None and np.array_equal(v, last)
            warmed += 1
        if sol.iterations > 0:  # type: ignore[attr-defined]
            last = sol.capacity_dual  # type: ignore[attr-defined]
    assert warmed >= 1
    carried = next(sol for _, sol in reversed(calls) if sol.iterations > 0)  # type: ignore[attr-defined]
    router.decide(qs, vs, Budget(window_usd=1.0), now=1.0)
    assert np.array_equal(calls[first][0], carried.capacity_dual)  # type: ignore[attr-defined,arg-type]
    other = [InstanceView(f"x{j}", v.model, v.state, v.free_slots) for j, v in enumerate(vs)]
    start = len(calls)
    router.decide(qs, other, Budget(window_usd=1.0), now=2.0)
    assert calls[start][0] is None
