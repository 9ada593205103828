"""Per-query policies share one loop: walk the window in arrival order, pick a column."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from routing.policies.common import (
    Ledger,
    Outcome,
    Window,
    decisions,
    mark_unfit,
    overspend,
    predict_ttft_in_order,
    prepare,
    rejected,
)
from routing.policies.context import RouterContext
from routing.types import Budget, InstanceView
from schemas import Decision, DecisionFlag, DecisionStatus, Query


class SequentialRouter:
    """Base of the per-query policies: ``choose`` picks a column for query ``i`` or -1."""

    name = "sequential"
    robust = False  # route on the lower bound instead of the mean

    def __init__(self, ctx: RouterContext, robust: bool | None = None) -> None:
        self.ctx = ctx
        if robust is not None:
            self.robust = robust

    def begin(self, win: Window) -> None:
        """Per-window set-up before the first ``choose``."""

    def choose(
        self, win: Window, ledger: Ledger, i: int, candidates: np.ndarray, out: Outcome
    ) -> int:
        raise NotImplementedError

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
        out = Outcome.empty(win.n, self.name)
        ledger = Ledger(win, budget)
        utility = win.utility(self.robust, self.ctx.lam_per_usd)
        self.begin(win)
        mark_unfit(win, out)
        for i in range(win.n):
            if win.unfit[i] is not None:
                continue
            room = ledger.room() & win.fits[i]
            candidates = room & ledger.affordable(i)
            if not candidates.any():
                if room.any():
                    out.reasons[i] = "over the window or tenant budget"
                    out.flags[i].append(DecisionFlag.BUDGET_DEFERRED)
                else:
                    out.reasons[i] = "no free slot on any instance that can hold it"
                continue
            k = self.choose(win, ledger, i, candidates, out)
            if k < 0:
                continue
            out.assignment[i] = k
            out.status[i] = DecisionStatus.ROUTED
            out.objective += float(utility[i, k])
            ledger.take(i, k)
        overspend(win, out, budget, "over the budget: allowed by configuration")
        out.bound = out.objective
        todo = np.isnan(out.ttft_ms) & (out.assignment >= 0)
        if todo.any() and self.ctx.report_ttft:
            full = predict_ttft_in_order(self.ctx, win, out.assignment)
            out.ttft_ms = np.where(todo, full, out.ttft_ms)
        return decisions(self.name, win, out, budget, now, self.robust)
