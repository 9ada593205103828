"""Paper A's TTFT check inside paper B's ILP: prune, solve, re-check with SFS, cut.

1. Pairs whose stand-alone SFS TTFT already breaks τ_i are infeasible.
2. A query left with no feasible column goes to its lowest-TTFT column alone and is
   flagged ``slo_infeasible`` (paper A's rule); it is not re-checked.
3. After each solve, SFS re-runs per column with all its assigned queries in arrival
   order. On a column whose first violating query sits at position r, two cuts are
   added: the pair (query, column) is removed, and the column may take at most as
   many new queries as met their SLOs in order once that query had left (>= r). A query left with no column by the first
   cut is instead flagged and pinned to its lowest stand-alone-TTFT column (rule 2),
   without the capacity cut. These cuts keep the problem a budgeted
   transportation problem, so the fast path applies unchanged. They are heuristic
   (another set of r+1 short queries might have fitted), which is the price of keeping
   the structure; each round strictly shrinks the mask or a capacity, so the loop ends.
4. After ``max_rounds`` re-solves, queries still violating are flagged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from routing.ilp.problem import BatchProblem, BoolArray, FloatArray, IntArray, Solution

# check(column, rows in arrival order, bounds) -> TTFT ms of each row when appended in that
# order; with bounds (one per row, inf: none) only the first row over its bound is needed:
# the check may stop there (that row's TTFT a lower bound over it, the rows after it NaN;
# ``routing.sfs.estimate_ttft_ms``'s ``over_ms``)
InOrderTtft = Callable[[int, IntArray, FloatArray | None], FloatArray]
Solver = Callable[[BatchProblem], Solution]


class _Checks:
    """The in-order checks of one window, each (column, rows, bounds) simulated once: a
    column that keeps its rows from one round to the next is not simulated again."""

    def __init__(self, in_order_ms: InOrderTtft) -> None:
        self._run = in_order_ms
        self._full: dict[tuple[int, bytes], FloatArray] = {}
        self._first: dict[tuple[int, bytes, bytes], FloatArray] = {}

    def __call__(self, k: int, rows: IntArray, over_ms: FloatArray | None) -> FloatArray:
        key = (k, rows.tobytes())
        full = self._full.get(key)
        if full is not None:
            return full
        if over_ms is None:
            full = self._full[key] = self._run(k, rows, None)
            return full
        key_first = (*key, over_ms.tobytes())
        first = self._first.get(key_first)
        if first is None:
            first = self._first[key_first] = self._run(k, rows, over_ms)
            if not np.isnan(first).any():  # nothing over: the simulation ran to the end
                self._full[key] = first
        return first


@dataclass
class TtftLoopResult:
    solution: Solution
    problem: BatchProblem
    slo_infeasible: BoolArray  # [n] flagged (no feasible column, or still violating)
    still_violating: BoolArray  # [n] subset of slo_infeasible: violated after the last round
    ttft_ms: FloatArray  # [n] in-order TTFT of routed queries (nan: deferred or unchecked)
    rounds: int


def prune_by_standalone(
    feasible: BoolArray, standalone_ms: FloatArray, slo_ms: FloatArray
) -> tuple[BoolArray, BoolArray]:
    """Mask of SLO-feasible pairs and the rows that have none (sent to their lowest TTFT)."""
    ok: BoolArray = feasible & (standalone_ms <= slo_ms[:, None])
    none: BoolArray = np.asarray(feasible.any(axis=1) & ~ok.any(axis=1), dtype=np.bool_)
    if none.any():
        rows = np.flatnonzero(none)
        best = np.where(feasible[rows], standalone_ms[rows], np.inf).argmin(axis=1)
        ok[rows, best] = True
    return ok, none


def solve_with_ttft_cuts(
    problem: BatchProblem,
    solver: Solver,
    in_order_ms: InOrderTtft,
    slo_ms: FloatArray,
    checked_columns: BoolArray,
    flagged: BoolArray,
    standalone_ms: FloatArray,
    max_rounds: int = 3,
) -> TtftLoopResult:
    """Solve, re-check every checked column with SFS, cut and re-solve (bounded rounds)."""
    n = problem.n
    flagged = flagged.copy()
    mask = problem.mask.copy()
    cap = problem.cap.copy()
    check = _Checks(in_order_ms)
    sol = solver(problem)
    rounds = 0
    while True:
        ttft = np.full(n, np.nan)
        violating = np.zeros(n, dtype=np.bool_)
        first: list[tuple[int, int, int]] = []  # (column, row, position)
        x = sol.assignment
        # before the last round a column's check needs only its first violator (a cut and
        # another round follow); the last round's TTFTs and violators are all reported
        last = rounds >= max_rounds
        for k in np.unique(x[x >= 0]).tolist():
            rows = np.flatnonzero(x == k)
            # one new query on a column: its in-order TTFT is its stand-alone TTFT
            # (SFS appends it after the residents either way), so skip a simulation
            if rows.size == 1:
                t = standalone_ms[rows, k]
            elif last or not checked_columns[k]:
                t = check(k, rows, None)
            else:
                t = check(k, rows, np.where(flagged[rows], np.inf, slo_ms[rows]))
            ttft[rows] = t
            if not checked_columns[k]:
                continue
            bad = (t > slo_ms[rows]) & ~flagged[rows]
            if bad.any():
                violating[rows[bad]] = True
                pos = int(np.flatnonzero(bad)[0])
                first.append((k, int(rows[pos]), pos))
        if not first or rounds >= max_rounds:
            break
        rounds += 1
        for k, i, pos in first:
            mask[i, k] = False
            if mask[i].any():
                # how many of the others fit in order once the violator has left
                rows = np.flatnonzero(x == k)
                rows = rows[rows != i]
                fits = pos
                if rows.size:
                    bound = np.where(flagged[rows], np.inf, slo_ms[rows])
                    ok = (check(k, rows, bound) <= slo_ms[rows]) | flagged[rows]
                    fits = int(np.argmin(ok)) if not ok.all() else int(rows.size)
                cap[k] = min(int(cap[k]), max(fits, pos, 1))
            else:
                # nothing left for this query: paper A's rule, lowest stand-alone TTFT
                j = int(
                    np.where(
                        problem.mask[i] | (standalone_ms[i] < np.inf), standalone_ms[i], np.inf
                    ).argmin()
                )
                mask[i, j] = True
                flagged[i] = True
        problem = problem.with_changes(feasible=mask, capacity=cap)
        sol = solver(problem)
    still = violating & ~flagged
    flagged |= violating
    return TtftLoopResult(sol, problem, flagged, still, ttft, rounds)
