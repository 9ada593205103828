"""Exact solvers for the window ILP: SCIP (pyscipopt) and HiGHS (scipy.optimize.milp).

Both solve the penalised form of ``problem.py`` with the deferral variable eliminated:
maximise Σ (a_ik + P)·x_ik − n·P subject to Σ_k x_ik <= 1, capacities and budgets.
Only feasible pairs get a variable. ``deadline`` is a ``time.perf_counter()`` value,
turned into the solver's time limit.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
from scipy.optimize import LinearConstraint, linprog, milp

from routing.ilp.problem import DEFERRED, BatchProblem, FloatArray, IntArray, Solution


def _time_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(1e-3, deadline - time.perf_counter())


def _rows(p: BatchProblem) -> tuple[sp.csr_matrix, np.ndarray, np.ndarray, np.ndarray, int]:
    """Constraint matrix over the feasible pairs: queries, capacities, budget, groups."""
    ii, jj = np.nonzero(p.mask)
    nv = ii.size
    cols = np.arange(nv)
    blocks = [
        sp.csr_matrix((np.ones(nv), (ii, cols)), shape=(p.n, nv)),
        sp.csr_matrix((np.ones(nv), (jj, cols)), shape=(p.k, nv)),
    ]
    ub = [np.ones(p.n), p.cap.astype(np.float64)]
    budget_row = -1
    if np.isfinite(p.budget_usd):
        # scaled to rhs 1 so that the solver's absolute feasibility tolerance is relative
        scale = 1.0 / p.budget_usd if p.budget_usd > 0 else 1.0
        budget_row = p.n + p.k
        blocks.append(sp.csr_matrix(p.c[ii, jj][None, :] * scale))
        ub.append(np.array([p.budget_usd * scale]))
    if p.has_groups:
        assert p.group is not None and p.group_budget_usd is not None
        g = p.group[ii]
        sel = g >= 0
        blocks.append(
            sp.csr_matrix(
                (p.c[ii, jj][sel], (g[sel], cols[sel])), shape=(len(p.group_budget_usd), nv)
            )
        )
        ub.append(np.where(np.isfinite(p.group_budget_usd), p.group_budget_usd, 1e300))
    return sp.vstack(blocks, format="csr"), np.concatenate(ub), ii, jj, budget_row


def _assignment(
    p: BatchProblem, ii: np.ndarray, jj: np.ndarray, vals: np.ndarray, repair: bool = True
) -> IntArray:
    """Read the 0/1 solution; a budget row broken within the solver's feasibility
    tolerance (~1e-6) is repaired by the cheapest downgrades: budgets are hard limits."""
    from routing.ilp.fast import _cut_spend, repair_groups

    x = np.full(p.n, DEFERRED, dtype=np.int64)
    on = vals > 0.5
    x[ii[on]] = jj[on]
    if p.violations(x) and not repair:
        return x
    if p.violations(x):
        x = repair_groups(p, _cut_spend(p, x))
    return x


def lp_budget_dual(p: BatchProblem) -> tuple[float, float]:
    """LP relaxation by HiGHS: (LP bound, dual of the budget row)."""
    if p.n == 0 or not p.mask.any():
        return p.objective(np.full(p.n, DEFERRED, dtype=np.int64)), 0.0
    A, ub, ii, jj, brow = _rows(p)
    obj = -(p.a[ii, jj] + p.penalty)
    res = linprog(obj, A_ub=A, b_ub=ub, bounds=(0, 1), method="highs")
    if res.status != 0:
        raise RuntimeError(f"LP relaxation failed: {res.message}")
    bound = -float(res.fun) - p.n * p.penalty
    scale = 1.0 / p.budget_usd if p.budget_usd > 0 else 1.0
    dual = -float(res.ineqlin.marginals[brow]) * scale if brow >= 0 else 0.0
    return bound, max(dual, 0.0)


def _tightened(p: BatchProblem, x: IntArray) -> BatchProblem | None:
    """The same problem with the budget lowered by twice what ``x`` overspends, or None."""
    excess = p.spend(x) - p.budget_usd
    if not np.isfinite(p.budget_usd) or excess <= 0:
        return None
    return BatchProblem(
        p.a,
        p.c,
        p.cap,
        max(0.0, p.budget_usd - 2 * excess),
        p.mask,
        p.group,
        p.group_budget_usd,
        p.penalty,
    )


def solve_highs(
    p: BatchProblem, gap_tol: float = 1e-9, deadline: float | None = None, with_dual: bool = False
) -> Solution:
    """Reference solver: HiGHS branch-and-bound via ``scipy.optimize.milp``."""
    sol = _solve_highs(p, gap_tol, deadline, with_dual)
    tight = _tightened(p, sol.assignment)
    if tight is None:
        return sol
    again = _solve_highs(tight, gap_tol, deadline, with_dual)
    ii, jj = np.nonzero(p.mask)
    x = _assignment(p, ii, jj, _onehot(p, again.assignment))
    return Solution(
        x,
        p.objective(x),
        max(sol.bound, p.objective(x)),
        again.budget_dual,
        p.spend(x),
        "highs",
        deadline_hit=again.deadline_hit,
    )


def _onehot(p: BatchProblem, x: IntArray) -> FloatArray:
    ii, jj = np.nonzero(p.mask)
    out: FloatArray = (x[ii] == jj).astype(np.float64)
    return out


def _solve_highs(
    p: BatchProblem, gap_tol: float, deadline: float | None, with_dual: bool
) -> Solution:
    if p.n == 0 or not p.mask.any():
        x = np.full(p.n, DEFERRED, dtype=np.int64)
        obj = p.objective(x)
        return Solution(x, obj, obj, 0.0, 0.0, "highs")
    A, ub, ii, jj, _ = _rows(p)
    opts: dict[str, float | bool] = {"mip_rel_gap": gap_tol, "disp": False}
    left = _time_left(deadline)
    if left is not None:
        opts["time_limit"] = left
    obj = -(p.a[ii, jj] + p.penalty)
    res = milp(
        obj,
        constraints=LinearConstraint(A, -np.inf, ub),
        integrality=np.ones(ii.size),
        bounds=(0, 1),
        options=opts,
    )
    if res.x is None:
        x = np.full(p.n, DEFERRED, dtype=np.int64)
        deadline_hit = True
    else:
        x = _assignment(p, ii, jj, res.x, repair=False)
        deadline_hit = res.status == 1
    objective = p.objective(x)
    dual_bound = getattr(res, "mip_dual_bound", None)
    bound = -float(dual_bound) - p.n * p.penalty if dual_bound is not None else objective
    dual = lp_budget_dual(p)[1] if with_dual else 0.0
    return Solution(
        x, objective, max(bound, objective), dual, p.spend(x), "highs", deadline_hit=deadline_hit
    )


def solve_scip(
    p: BatchProblem,
    gap_tol: float = 1e-9,
    deadline: float | None = None,
    start: IntArray | None = None,
    with_dual: bool = False,
    threads: int = 1,
) -> Solution:
    """Exact solver: SCIP with default settings; ``start`` is handed over as a first solution.

    A budget row the solver meets only within its feasibility tolerance is re-solved
    once with the budget lowered by twice the excess, then repaired if still broken.
    """
    sol = _solve_scip(p, gap_tol, deadline, start, with_dual, threads)
    tight = _tightened(p, sol.assignment)
    if tight is None:
        return sol
    again = _solve_scip(tight, gap_tol, deadline, None, with_dual, threads)
    ii, jj = np.nonzero(p.mask)
    x = _assignment(p, ii, jj, _onehot(p, again.assignment))
    return Solution(
        x,
        p.objective(x),
        max(sol.bound, p.objective(x)),
        again.budget_dual,
        p.spend(x),
        sol.solver,
        deadline_hit=again.deadline_hit,
        status=again.status,
    )


def _solve_scip(
    p: BatchProblem,
    gap_tol: float,
    deadline: float | None,
    start: IntArray | None,
    with_dual: bool,
    threads: int,
) -> Solution:
    from pyscipopt import Model, quicksum

    solver = "scip" if start is None else "fast+scip"
    if p.n == 0 or not p.mask.any():
        x = np.full(p.n, DEFERRED, dtype=np.int64)
        obj = p.objective(x)
        return Solution(x, obj, obj, 0.0, 0.0, solver)
    ii, jj = np.nonzero(p.mask)
    model = Model("window")
    model.hideOutput()
    model.setParam("limits/gap", gap_tol)
    model.setParam("parallel/maxnthreads", threads)
    left = _time_left(deadline)
    if left is not None:
        model.setParam("limits/time", left)
    w = (p.a[ii, jj] + p.penalty).tolist()
    xs = [model.addVar(vtype="B", obj=w[t]) for t in range(ii.size)]
    model.setMaximize()
    by_row: list[list[int]] = [[] for _ in range(p.n)]
    by_col: list[list[int]] = [[] for _ in range(p.k)]
    for t, (i, j) in enumerate(zip(ii.tolist(), jj.tolist(), strict=True)):
        by_row[i].append(t)
        by_col[j].append(t)
    for ts in by_row:
        if len(ts) > 1:
            model.addCons(quicksum(xs[t] for t in ts) <= 1)
    for j, ts in enumerate(by_col):
        if len(ts) > int(p.cap[j]):
            model.addCons(quicksum(xs[t] for t in ts) <= int(p.cap[j]))
    c = p.c[ii, jj].tolist()
    if np.isfinite(p.budget_usd):
        scale = 1.0 / p.budget_usd if p.budget_usd > 0 else 1.0
        model.addCons(
            quicksum(xs[t] * (c[t] * scale) for t in range(ii.size)) <= p.budget_usd * scale
        )
    if p.has_groups:
        assert p.group is not None and p.group_budget_usd is not None
        g = p.group[ii]
        for gi, gb in enumerate(p.group_budget_usd.tolist()):
            ts = np.flatnonzero(g == gi).tolist()
            if ts and np.isfinite(gb):
                model.addCons(quicksum(xs[t] * c[t] for t in ts) <= gb)
    if start is not None:
        sol = model.createSol()
        on = np.zeros(p.n * max(p.k, 1), dtype=np.bool_)
        routed = np.flatnonzero(start >= 0)
        on[routed * p.k + start[routed]] = True
        flat = ii * p.k + jj
        for t in range(ii.size):
            model.setSolVal(sol, xs[t], 1.0 if on[flat[t]] else 0.0)
        model.addSol(sol, free=True)
    model.optimize()
    if model.getNSols() == 0:
        x = np.full(p.n, DEFERRED, dtype=np.int64) if start is None else start.copy()
    else:
        best = model.getBestSol()
        vals = np.array([model.getSolVal(best, v) for v in xs])
        x = _assignment(p, ii, jj, vals, repair=False)
    objective = p.objective(x)
    bound = float(model.getDualbound()) - p.n * p.penalty
    status = str(model.getStatus())
    dual = lp_budget_dual(p)[1] if with_dual else 0.0
    return Solution(
        x,
        objective,
        max(bound, objective),
        dual,
        p.spend(x),
        solver,
        deadline_hit=status in ("timelimit", "userinterrupt"),
        status=status,
    )
