"""Robust batch ILP of a routing window (paper B, with paper A's TTFT check as cuts)."""

from routing.ilp.fast import WarmStart, dual_bound, greedy_feasible, solve_fast
from routing.ilp.problem import DEFERRED, BatchProblem, Solution, relative_gap
from routing.ilp.solve import METHODS, Method, solve

__all__ = [
    "DEFERRED",
    "METHODS",
    "BatchProblem",
    "Method",
    "Solution",
    "WarmStart",
    "dual_bound",
    "greedy_feasible",
    "relative_gap",
    "solve",
    "solve_fast",
]
