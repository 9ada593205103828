"""Batch ILP routing (paper B): one robust ILP per window under budget and capacity.

    maximise Σ (a^LB_ij − λ·cost_ij − δ·L̂_ij/τ_i) x_ij  s.t.  one instance per query,
    Σ cost <= window budget and each tenant's remaining budget, Σ_i x_ij <= free slots
    of instance j, and (``batch-ilp-sfs``) m·L̂_ij <= τ_i

Columns are instances. Solved by ``routing.ilp`` (fast path by default, warm-started
from the previous window's budget multiplier). Queries that do not fit are deferred,
or routed ``over_budget`` when the budget allows overspend. ``batch-ilp`` has no
latency term; ``batch-ilp-sfs`` adds paper A's SFS TTFT check as constraints
(``routing.ilp.ttft_cuts``) and, in the objective, paper A's latency penalty with
weight δ (``delta``; L̂_ij the stand-alone SFS TTFT of query i on instance j, τ_i what
is left of its SLO). ``ttft_margin`` m is a calibrated multiplier on the predicted TTFT
(``routing.sfs_margin``: a high quantile of observed/predicted TTFT): the constraint is
on that quantile rather than on the point estimate, so SFS's errors under load do not
turn "just meets the SLO" into a miss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from routing.ilp import BatchProblem, Method, Solution, WarmStart, solve
from routing.ilp.ttft_cuts import prune_by_standalone, solve_with_ttft_cuts
from routing.policies.common import (
    Outcome,
    Window,
    budget_groups,
    decisions,
    mark_unfit,
    overspend,
    predict_ttft_in_order,
    prepare,
    rejected,
)
from routing.policies.context import RouterContext
from routing.prefix import ColumnPrefix
from routing.types import Budget, InstanceView, IntArray
from schemas import Decision, DecisionFlag, DecisionStatus, Query


class BatchIlpRouter:
    name = "batch-ilp"
    robust = True
    use_sfs = False
    default_delta = 0.0

    def __init__(
        self,
        ctx: RouterContext,
        method: Method = "fast",
        gap_tol: float = 1e-3,
        deadline_ms: float | None = None,
        max_ttft_rounds: int = 3,
        robust: bool | None = None,
        delta: float | None = None,
        ttft_margin: float = 1.0,
    ) -> None:
        if not math.isfinite(gap_tol) or gap_tol < 0:
            raise ValueError(f"gap_tol must be a finite number >= 0, got {gap_tol}")
        if deadline_ms is not None and (not math.isfinite(deadline_ms) or deadline_ms <= 0):
            raise ValueError(f"deadline_ms must be a finite number > 0, got {deadline_ms}")
        if max_ttft_rounds < 0:
            raise ValueError(f"max_ttft_rounds must be >= 0, got {max_ttft_rounds}")
        delta = self.default_delta if delta is None else delta
        if not math.isfinite(delta) or delta < 0:
            raise ValueError(f"delta must be a finite number >= 0, got {delta}")
        if delta > 0 and not self.use_sfs:
            raise ValueError(f"{self.name} has no TTFT estimate: delta needs batch-ilp-sfs")
        if not math.isfinite(ttft_margin) or ttft_margin <= 0:
            raise ValueError(f"ttft_margin must be a finite number > 0, got {ttft_margin}")
        self.delta = delta
        self.ttft_margin = ttft_margin
        self.ctx = ctx
        self.method: Method = method
        self.gap_tol = gap_tol
        self.deadline_ms = deadline_ms
        self.max_ttft_rounds = max_ttft_rounds
        if robust is not None:
            self.robust = robust
        self._warm = WarmStart()
        # the capacity multipliers of the last window's last solve, and its columns
        self._warm_v: np.ndarray | None = None
        self._warm_cols: tuple[str, ...] = ()

    def _solve(
        self, problem: BatchProblem, deadline: float | None, v: np.ndarray | None = None
    ) -> Solution:
        """One solve, warm from the last solve's budget multiplier (and, within a window's
        rounds of TTFT cuts, from the last round's capacity multipliers ``v``)."""
        sol = solve(
            problem,
            self.method,
            gap_tol=self.gap_tol,
            deadline=deadline,
            with_dual=self.method in ("scip", "highs"),  # the fast path reports its μ anyway
            warm=self._warm if v is None else WarmStart(mu=self._warm.mu, v=v),
        )
        if math.isfinite(sol.budget_dual):
            self._warm = WarmStart(mu=sol.budget_dual)
        return sol

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        if not instances:
            return rejected(self.name, queries, budget, now, "no instance to route to")
        win = prepare(self.ctx, queries, instances, now)
        if win.n == 0:
            return []
        deadline = (
            None if self.deadline_ms is None else time.perf_counter() + self.deadline_ms / 1e3
        )
        utility = win.utility(self.robust, self.ctx.lam_per_usd)
        candidate = (win.usable & (win.capacity > 0))[None, :] & win.fits
        group, limits = budget_groups(win.queries, budget)
        out = Outcome.empty(win.n, self.method)
        flagged = np.zeros(win.n, dtype=np.bool_)
        # the SLO the TTFT *quantile* must meet: m·L̂ <= τ  <=>  L̂ <= τ/m
        slo_check_ms = win.slo_ms / self.ttft_margin

        def problem_of(standalone: np.ndarray) -> tuple[BatchProblem, np.ndarray]:
            a, feasible, none = utility, candidate, np.zeros(win.n, dtype=np.bool_)
            if self.use_sfs:
                feasible, none = prune_by_standalone(candidate, standalone, slo_check_ms)
                if self.delta > 0:
                    a = utility - latency_penalty(standalone, win.slo_ms, self.delta)
            problem = BatchProblem(
                utility=a,
                cost_usd=win.cost_usd,
                capacity=win.capacity,
                budget_usd=budget.window_usd,
                feasible=feasible,
                group=group if limits.size else None,
                group_budget_usd=limits if limits.size else None,
            )
            return problem, none

        standalone = self._standalone(win, candidate)
        problem, flagged = problem_of(standalone)
        if self.use_sfs and self._warms(win):
            # queries sharing a prefix with an earlier one: where that one goes, its prefill
            # will have cached the shared part — price that pair so, and solve again
            first = self._solve(problem, deadline).assignment
            if self._warm_up(win, candidate, standalone, first):
                problem, flagged = problem_of(standalone)
        rounds = 0
        still = np.zeros(win.n, dtype=np.bool_)
        if self.use_sfs:

            def in_order(k: int, rows: IntArray, over_ms: np.ndarray | None) -> np.ndarray:
                return self.ctx.ttft_model.in_order_ms(
                    win.views[k],
                    win.prompt_tokens[rows],
                    win.output_tokens[rows, k],
                    win.column_prefix(k, rows),
                    over_ms,
                )

            # a round's problem is the last one with a pair or a capacity cut, and a window
            # the last one's on the same instances with other queries: the last solve's
            # capacity multipliers are close to the optimum (fewer L-BFGS steps)
            cols = tuple(view.instance_id for view in win.views)
            last_v = self._warm_v if self._warm_v is not None and self._warm_cols == cols else None

            def solve_round(p: BatchProblem) -> Solution:
                nonlocal last_v
                sol = self._solve(p, deadline, last_v)
                if sol.capacity_dual is not None and sol.iterations > 0:
                    # (a solve that closed at μ = v = 0 at once keeps the last ones)
                    last_v = sol.capacity_dual
                return sol

            res = solve_with_ttft_cuts(
                problem,
                solve_round,
                in_order,
                slo_check_ms,
                ~win.estimate,
                flagged,
                standalone,
                self.max_ttft_rounds,
            )
            self._warm_cols, self._warm_v = cols, last_v
            sol, problem, flagged, still, ttft, rounds = (
                res.solution,
                res.problem,
                res.slo_infeasible,
                res.still_violating,
                res.ttft_ms,
                res.rounds,
            )
        else:
            sol = self._solve(problem, deadline)
            ttft = (
                predict_ttft_in_order(self.ctx, win, sol.assignment)
                if self.ctx.report_ttft
                else np.full(win.n, np.nan)
            )
        self._fill(win, problem, sol, out, flagged, still)
        mark_unfit(win, out)
        out.ttft_ms = ttft
        out.ttft_rounds = rounds
        overspend(win, out, budget, "over the budget: allowed by configuration")
        over = np.array([s == DecisionStatus.OVER_BUDGET for s in out.status], dtype=np.bool_)
        if over.any() and (self.use_sfs or self.ctx.report_ttft):
            out.ttft_ms = predict_ttft_in_order(self.ctx, win, out.assignment)
        return decisions(self.name, win, out, budget, now, self.robust)

    def _standalone(self, win: Window, candidate: np.ndarray) -> np.ndarray:
        """Stand-alone SFS TTFT of every candidate pair with its cache hits (inf where a
        pair is not a candidate at all, so no fallback rule ever picks it)."""
        standalone = np.where(candidate, 0.0, np.inf)
        if not self.use_sfs:
            return standalone
        for k in np.flatnonzero(candidate.any(axis=0)).tolist():
            rows = np.flatnonzero(candidate[:, k])
            standalone[rows, k] = self.ctx.ttft_model.standalone_ms(
                win.views[k],
                win.prompt_tokens[rows],
                win.output_tokens[rows, k],
                win.column_prefix(k, rows, in_order=False),
            )
        return standalone

    @staticmethod
    def _warms(win: Window) -> bool:
        p = win.warm_parent
        return bool(((p >= 0) & (win.warm_tokens > win.hit_tokens.min(axis=1))).any())

    def _warm_up(
        self, win: Window, candidate: np.ndarray, standalone: np.ndarray, first: np.ndarray
    ) -> bool:
        """Re-price (child, its parent's instance) pairs with the shared prefix cached."""
        child = np.flatnonzero(win.warm_parent >= 0)
        k = first[win.warm_parent[child]]
        keep = k >= 0
        child, k = child[keep], k[keep]
        keep = candidate[child, k] & (win.warm_tokens[child] > win.hit_tokens[child, k])
        child, k = child[keep], k[keep]
        if not child.size:
            return False
        for col in np.unique(k).tolist():
            rows = child[k == col]
            hits = np.maximum(win.hit_tokens[rows, col], win.warm_tokens[rows])
            standalone[rows, col] = self.ctx.ttft_model.standalone_ms(
                win.views[col],
                win.prompt_tokens[rows],
                win.output_tokens[rows, col],
                ColumnPrefix(hits, None, np.ones(rows.size)),
            )
        return True

    def _fill(
        self,
        win: Window,
        problem: BatchProblem,
        sol: Solution,
        out: Outcome,
        flagged: np.ndarray,
        still: np.ndarray,
    ) -> None:
        x = sol.assignment
        out.assignment = x.copy()
        out.solver = sol.solver
        out.objective, out.bound, out.gap, out.budget_dual = (
            sol.objective,
            sol.bound,
            sol.gap,
            sol.budget_dual,
        )
        free = problem.cap - np.bincount(x[x >= 0], minlength=win.k)
        for i in range(win.n):
            if sol.deadline_hit:
                out.flags[i].append(DecisionFlag.DEADLINE)
            if x[i] >= 0:
                out.status[i] = DecisionStatus.ROUTED
                if flagged[i]:
                    out.flags[i].append(DecisionFlag.SLO_INFEASIBLE)
                    out.reasons[i] = (
                        f"TTFT re-check still over the {win.slo_ms[i]:g} ms SLO after "
                        f"{self.max_ttft_rounds} rounds"
                        if still[i]
                        else f"no instance meets the {win.slo_ms[i]:g} ms TTFT SLO: lowest estimated TTFT"
                    )
                continue
            cols = problem.mask[i]
            if not cols.any():
                out.reasons[i] = "no instance with a free slot that can hold it"
            elif not (free[cols] > 0).any():
                out.reasons[i] = "no free slot left on its feasible instances in this window"
            else:
                out.reasons[i] = "did not fit in the window or tenant budget"
                out.flags[i].append(DecisionFlag.BUDGET_DEFERRED)


class BatchIlpSfsRouter(BatchIlpRouter):
    """Ours, the default: batch ILP with SFS-checked TTFT constraints (paper B + A)."""

    name = "batch-ilp-sfs"
    use_sfs = True
    default_delta = 0.05  # the same default as latency-aware's δ


def latency_penalty(ttft_ms: np.ndarray, slo_ms: np.ndarray, delta: float) -> np.ndarray:
    """Paper A's Lagrangian latency term ``δ · L̂_ij / τ_i`` (``[n, k]``). The ratio is
    capped at 10: only a query that no instance can serve in time (pinned to its lowest
    TTFT, paper A's rule) gets there, and an infinite estimate must stay a finite utility."""
    tau = np.maximum(slo_ms, 1e-9)[:, None]
    ratio = np.minimum(np.nan_to_num(ttft_ms, nan=10.0, posinf=1e12) / tau, 10.0)
    out: np.ndarray = delta * ratio
    return out


def make_batch_ilp(ctx: RouterContext, **kwargs: object) -> BatchIlpRouter:
    return BatchIlpRouter(ctx, **kwargs)  # type: ignore[arg-type]
