"""Window ILP: feasibility invariants, brute-force optima, certified gaps, bad inputs."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routing.ilp import DEFERRED, BatchProblem, dual_bound, solve, solve_fast
from routing.ilp.exact import lp_budget_dual
from routing.ilp.fast import _auction

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw: st.DrawFn, max_n: int = 5, max_k: int = 3, groups: bool = False) -> BatchProblem:
    n = draw(st.integers(0, max_n))
    k = draw(st.integers(1, max_k))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    a = np.round(rng.uniform(-0.2, 1.0, (n, k)), 3)
    c = np.round(rng.uniform(0.0, 1.0, (n, k)), 3)
    feasible = rng.random((n, k)) > draw(st.sampled_from([0.0, 0.2, 0.5]))
    cap = rng.integers(0, n + 1, k)
    total = float(np.where(feasible, c, 0).max(axis=1).sum()) if n else 0.0
    budget = draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, float("inf")])) * total
    if np.isinf(budget) or np.isnan(budget):
        budget = float("inf")
    g = gb = None
    if groups and n:
        g = rng.integers(-1, 2, n)
        gb = np.round(rng.uniform(0, 1.5, 2), 3)
    return BatchProblem(a, c, cap, budget, feasible=feasible, group=g, group_budget_usd=gb)


def brute_force(p: BatchProblem) -> tuple[float, np.ndarray]:
    best, best_x = -np.inf, np.full(p.n, DEFERRED)
    for combo in itertools.product(range(-1, p.k), repeat=p.n):
        x = np.array(combo, dtype=np.int64)
        if p.violations(x):
            continue
        obj = p.objective(x)
        if obj > best + 1e-12:
            best, best_x = obj, x
    return best, best_x


def assert_decided_once(p: BatchProblem, x: np.ndarray) -> None:
    assert x.shape == (p.n,)
    assert ((x >= -1) & (x < p.k)).all()


@SETTINGS
@given(problems())
def test_fast_is_feasible_and_its_bound_covers_brute_force(p: BatchProblem) -> None:
    opt, _ = brute_force(p)
    sol = solve_fast(p, gap_tol=1e-3)
    assert_decided_once(p, sol.assignment)
    assert p.violations(sol.assignment) == []
    assert sol.objective == pytest.approx(p.objective(sol.assignment))
    assert sol.objective <= opt + 1e-9
    assert sol.bound >= opt - 1e-7 * max(1.0, abs(opt))  # a valid upper bound
    assert opt - sol.objective <= sol.gap * max(abs(sol.objective), 1e-9) + 1e-7


@SETTINGS
@given(problems(groups=True))
def test_exact_solvers_match_brute_force_with_tenant_rows(p: BatchProblem) -> None:
    opt, _ = brute_force(p)
    for method in ("scip", "highs", "fast+scip"):
        sol = solve(p, method, gap_tol=0.0)  # type: ignore[arg-type]
        assert p.violations(sol.assignment) == [], method
        assert sol.objective == pytest.approx(opt, abs=1e-6), method
    fast = solve(p, "fast")
    assert p.violations(fast.assignment) == []
    assert fast.bound >= opt - 1e-7 * max(1.0, abs(opt))


@settings(max_examples=8, deadline=None)
@given(st.integers(20, 120), st.integers(2, 8), st.integers(0, 10_000))
def test_fast_objective_within_its_gap_of_scip(n: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.uniform(0, 1, (n, k))
    c = rng.uniform(0, 1e-3, (n, k)) * (1 + np.arange(k))[None, :]
    cap = rng.integers(n // k, n, k)
    p = BatchProblem(
        a, c, cap, float(c.mean(axis=1).sum() * 0.6), feasible=rng.random((n, k)) > 0.1
    )
    exact = solve(p, "scip", gap_tol=0.0)
    fast = solve(p, "fast", gap_tol=1e-3)
    assert p.violations(fast.assignment) == [] and p.violations(exact.assignment) == []
    assert fast.objective <= exact.objective + 1e-7
    assert exact.objective - fast.objective <= fast.gap * abs(fast.objective) + 1e-7
    assert fast.bound >= exact.objective - 1e-7
    both = solve(p, "fast+scip", gap_tol=1e-9)
    assert both.objective >= fast.objective - 1e-9


def test_binding_budget_and_capacity_are_respected_at_scale() -> None:
    rng = np.random.default_rng(3)
    n, k = 600, 12
    a = rng.uniform(0, 1, (n, k)) + np.linspace(0, 0.5, k)
    c = rng.uniform(0.5, 1.5, (n, k)) * np.geomspace(1e-5, 1e-3, k)
    cap = np.full(k, 100)
    # affordable by construction: query i on column i // 100 (columns 0..5), times 1.5
    p = BatchProblem(a, c, cap, float(c[np.arange(n), np.arange(n) // 100].sum() * 1.5))
    sol = solve_fast(p, gap_tol=1e-3)
    assert p.violations(sol.assignment) == []
    assert sol.n_deferred == 0
    assert sol.spend_usd <= p.budget_usd
    assert sol.gap <= 1e-3
    assert sol.budget_dual > 0  # the budget binds
    lp_bound, lp_dual = lp_budget_dual(p)
    assert sol.bound >= lp_bound - 1e-6 * abs(lp_bound)
    assert sol.budget_dual == pytest.approx(lp_dual, rel=0.25)


def test_unaffordable_window_defers_the_fewest_queries() -> None:
    # 4 queries, one column with cost 1 each, budget 2.5: two fit, two are deferred
    p = BatchProblem(np.ones((4, 1)), np.ones((4, 1)), np.array([4]), 2.5)
    for method in ("fast", "scip", "highs"):
        sol = solve(p, method)  # type: ignore[arg-type]
        assert sol.n_deferred == 2, method
        assert sol.spend_usd <= 2.5


def test_no_capacity_anywhere_defers_everything() -> None:
    p = BatchProblem(np.ones((3, 2)), np.zeros((3, 2)), np.array([0, 0]), 1.0)
    sol = solve_fast(p)
    assert (sol.assignment == DEFERRED).all()


def test_deadline_in_the_past_still_returns_a_feasible_assignment() -> None:
    rng = np.random.default_rng(1)
    a, c = rng.uniform(0, 1, (200, 6)), rng.uniform(0, 1, (200, 6))
    p = BatchProblem(a, c, np.full(6, 50), 40.0)
    sol = solve_fast(p, gap_tol=1e-9, deadline=time.perf_counter() - 1.0)
    assert sol.deadline_hit
    assert p.violations(sol.assignment) == []


def test_dual_bound_is_valid_for_any_multipliers() -> None:
    rng = np.random.default_rng(2)
    p = BatchProblem(rng.uniform(0, 1, (5, 3)), rng.uniform(0, 1, (5, 3)), np.array([2, 2, 5]), 1.2)
    opt, _ = brute_force(p)
    for _ in range(50):
        assert dual_bound(p, float(rng.exponential(2)), rng.exponential(0.3, 3)) >= opt - 1e-12


def test_auction_matches_brute_force_without_budget() -> None:
    rng = np.random.default_rng(4)
    for _ in range(20):
        p = BatchProblem(rng.uniform(0, 1, (5, 3)), np.zeros((5, 3)), rng.integers(0, 4, 3))
        opt, _ = brute_force(p)
        s = np.where(p.mask, p.a, -np.inf)
        x, v, _ = _auction(s, -p.penalty, p.cap, np.zeros(3), 1e-6, 0.2, 10_000)
        assert p.violations(x) == []
        assert p.objective(x) == pytest.approx(opt, abs=1e-4)
        assert dual_bound(p, 0.0, v) >= opt - 1e-9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"utility": np.array([[np.nan, 1.0]])}, r"utility\[0, 0\] is nan"),
        ({"utility": np.array([[1.0, np.inf]])}, r"utility\[0, 1\] is inf"),
        ({"cost_usd": np.array([[-1.0, 1.0]])}, r"cost_usd\[0, 0\] is -1.0"),
        ({"cost_usd": np.array([[1.0, np.nan]])}, r"cost_usd\[0, 1\] is nan"),
        ({"capacity": np.array([1, -2])}, r"capacity\[1\] must be >= 0"),
        ({"capacity": np.array([1.0, np.nan])}, r"capacity\[1\] must be >= 0"),
        ({"budget_usd": float("nan")}, r"budget_usd must be >= 0"),
        ({"budget_usd": -1.0}, r"budget_usd must be >= 0"),
        ({"cost_usd": np.ones((2, 2))}, r"cost_usd has shape \(2, 2\), expected \(1, 2\)"),
        ({"defer_penalty": float("inf")}, r"defer_penalty must be finite"),
    ],
)
def test_bad_inputs_give_clear_errors(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "utility": np.array([[0.5, 1.0]]),
        "cost_usd": np.array([[0.1, 0.2]]),
        "capacity": np.array([1, 1]),
        "budget_usd": 1.0,
    }
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        BatchProblem(**base)  # type: ignore[arg-type]


def test_values_at_infeasible_pairs_are_ignored() -> None:
    p = BatchProblem(
        np.array([[np.nan, 1.0]]),
        np.array([[np.inf, 0.1]]),
        np.array([1, 1]),
        1.0,
        feasible=np.array([[False, True]]),
    )
    assert solve_fast(p).assignment.tolist() == [1]


def test_unknown_method_is_named() -> None:
    p = BatchProblem(np.ones((1, 1)), np.zeros((1, 1)), np.array([1]))
    with pytest.raises(ValueError, match="unknown ILP method 'cplex'"):
        solve(p, "cplex")  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7, 8, 12, 40])
def test_row_reductions_equal_numpys_bit_for_bit(k: int) -> None:
    """The fast path's row max and row sum (``_row_max``, ``_row_sum``) give numpy's
    ``max(axis=1)`` and ``sum(axis=1)`` to the last bit: magnitudes 1e-12..1e12, signed
    zeros, -inf, and exp-like rows in [0, 1]."""
    from routing.ilp.fast import _row_max, _row_sum

    rng = np.random.default_rng(k)
    n = 4000
    z = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-12, 12, (n, k))
    z[rng.random((n, k)) < 0.05] = 0.0
    z[rng.random((n, k)) < 0.05] = -0.0
    z[rng.random((n, k)) < 0.05] = -np.inf
    for a in (z, np.exp(np.minimum(z, 0.0)), np.abs(z)):
        got, want = _row_max(a), a.max(axis=1)
        np.testing.assert_array_equal(got, want)
        assert (np.signbit(got) == np.signbit(want)).all()
        if np.isfinite(a).all():
            assert _row_sum(a).tobytes() == a.sum(axis=1, dtype=np.float64).tobytes()
    f32 = np.exp(np.minimum(z, 0.0)).astype(np.float32)
    assert _row_max(f32).tobytes() == f32.max(axis=1).tobytes()


def _capacity_bound_window(seed: int, n: int = 600, k: int = 4) -> BatchProblem:
    """A window whose best columns hold fewer queries than want them (capacities bind)."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.2, 0.4, (n, k)) + np.array([0.3, 0.3, 0.0, 0.0])[:k]
    c = rng.uniform(1e-5, 1e-4, (n, k))
    return BatchProblem(a, c, np.array([150, 150, 1000, 1000])[:k], float("inf"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_capacity_cut_resolved_warm_from_the_last_multipliers(seed: int) -> None:
    """The fast path reports its capacity multipliers; a re-solve after a capacity cut
    (as a round of TTFT cuts does) started from them is feasible, within its certified
    gap of the cold solve's bound, and takes fewer evaluations."""
    from routing.ilp import WarmStart

    p = _capacity_bound_window(seed)
    first = solve_fast(p)
    assert first.capacity_dual is not None and first.capacity_dual.shape == (p.k,)
    assert (first.capacity_dual >= 0).all() and first.capacity_dual[:2].min() > 0  # they bind
    # the certificate: the bound is D at the reported multipliers
    assert dual_bound(p, first.budget_dual, first.capacity_dual) == pytest.approx(first.bound)
    cut = p.with_changes(capacity=np.array([150, 120, 1000, 1000]))
    cold = solve_fast(cut)
    warm = solve_fast(cut, warm=WarmStart(mu=first.budget_dual, v=first.capacity_dual))
    assert cut.violations(warm.assignment) == []
    assert warm.gap <= 1e-3
    assert warm.objective >= cold.bound - 1e-3 * abs(cold.bound) - 1e-9
    assert warm.iterations < cold.iterations


def test_smoothed_dual_without_a_budget_multiplier_is_the_same_bit_for_bit() -> None:
    """At μ = 0 the smoothed dual skips ``a − μ·c``: its value and gradient are those of
    the full expression to the last bit (masked pairs at −inf, signed zeros included)."""
    from routing.ilp.fast import _Smoothed

    rng = np.random.default_rng(5)
    n, k = 500, 4
    a = rng.uniform(-1, 1, (n, k))
    a[rng.random((n, k)) < 0.2] = -np.inf
    a[:5, 0] = -0.0
    c = rng.uniform(0, 1e-3, (n, k))
    f = _Smoothed(a=a, c=c, cap=np.full(k, 100.0), budget=0.5, penalty=1.0, tau=0.003)
    ref = _Smoothed(a=a, c=c, cap=np.full(k, 100.0), budget=0.5, penalty=1.0, tau=0.003)
    ref._c_finite = False  # forces the full expression
    for z in (np.array([0.0, 0.0, 0.1, 0.0, 0.3]), np.array([0.0, 0.2, 0.0, 0.05, 0.0])):
        v1, g1 = f(z)
        v2, g2 = ref(z)
        assert v1 == v2
        assert g1.tobytes() == g2.tobytes()


def test_group_spend_is_np_add_at_bit_for_bit() -> None:
    """``group_spend`` sums each tenant's costs in row order, as ``np.add.at`` would."""
    rng = np.random.default_rng(7)
    n, k, groups = 3000, 4, 5
    c = rng.uniform(0, 1, (n, k)) * 10.0 ** rng.integers(-9, 3, (n, k))
    g = rng.integers(-1, groups, n)
    p = BatchProblem(np.zeros((n, k)), c, np.full(k, n), 1.0, group=g,
                     group_budget_usd=np.ones(groups))  # fmt: skip
    x = rng.integers(-1, k, n)
    rows = np.flatnonzero((x >= 0) & (g >= 0))
    want = np.zeros(groups)
    np.add.at(want, g[rows], c[rows, x[rows]])
    assert p.group_spend(x).tobytes() == want.tobytes()
    assert p.group_spend(np.full(n, -1)).tobytes() == np.zeros(groups).tobytes()
