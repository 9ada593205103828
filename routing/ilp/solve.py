"""One entry point for the window ILP: ``solve(problem, method)``.

Methods: ``fast`` (Lagrangian + auction, certified gap), ``scip`` (exact, default
settings), ``fast+scip`` (fast first; SCIP starts from its solution only when the
certified gap is above ``gap_tol``), ``highs`` (scipy.optimize.milp reference).
"""

from __future__ import annotations

from typing import Literal

from routing.ilp.exact import solve_highs, solve_scip
from routing.ilp.fast import WarmStart, solve_fast
from routing.ilp.problem import BatchProblem, Solution

Method = Literal["fast", "scip", "fast+scip", "highs"]
METHODS: tuple[Method, ...] = ("fast", "scip", "fast+scip", "highs")


def solve(
    problem: BatchProblem,
    method: Method = "fast",
    gap_tol: float = 1e-3,
    deadline: float | None = None,
    with_dual: bool = False,
    warm: WarmStart | None = None,
) -> Solution:
    """Solve one window. ``deadline``: a ``time.perf_counter()`` value, or None.

    ``gap_tol`` is the relative gap at which a solver may stop (exact methods are
    asked for 1e-9 when ``gap_tol`` is 0).
    """
    if method == "fast":
        return solve_fast(problem, gap_tol=gap_tol, deadline=deadline, warm=warm)
    if method == "scip":
        return solve_scip(
            problem, gap_tol=max(gap_tol, 1e-9), deadline=deadline, with_dual=with_dual
        )
    if method == "highs":
        return solve_highs(
            problem, gap_tol=max(gap_tol, 1e-9), deadline=deadline, with_dual=with_dual
        )
    if method == "fast+scip":
        first = solve_fast(problem, gap_tol=gap_tol, deadline=deadline, warm=warm)
        if first.gap <= gap_tol or first.deadline_hit:
            return Solution(
                first.assignment,
                first.objective,
                first.bound,
                first.budget_dual,
                first.spend_usd,
                "fast+scip",
                first.iterations,
                first.deadline_hit,
            )
        exact = solve_scip(
            problem, gap_tol=max(gap_tol, 1e-9), deadline=deadline, start=first.assignment
        )
        if exact.objective < first.objective:  # deadline before SCIP improved on the start
            return Solution(
                first.assignment,
                first.objective,
                min(first.bound, exact.bound) if exact.bound >= first.objective else first.bound,
                first.budget_dual,
                first.spend_usd,
                "fast+scip",
                first.iterations,
                True,
            )
        return Solution(
            exact.assignment,
            exact.objective,
            min(exact.bound, first.bound),
            first.budget_dual,
            exact.spend_usd,
            "fast+scip",
            first.iterations,
            exact.deadline_hit,
            exact.status,
        )
    raise ValueError(f"unknown ILP method {method!r}; choose one of {list(METHODS)}")
