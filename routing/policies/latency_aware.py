"""Per-query latency-aware routing with SFS (paper A).

    m(i) = argmax_j  U_ij − δ · L̂_ij / τ_i   subject to  L̂_ij <= τ_i

with U_ij = a_ij − λ·cost_ij and L̂_ij the SFS TTFT of query i on instance j behind
the queries this window already sent there (with its prefix-cache hits there, including
what those queries will have cached by its turn). No instance meets the SLO → the one with
the lowest estimated TTFT, flagged ``slo_infeasible`` (paper A's rule).
"""

from __future__ import annotations

import math

import numpy as np

from routing.policies.base import SequentialRouter
from routing.policies.common import Ledger, Outcome, Window
from routing.policies.context import RouterContext
from schemas import DecisionFlag


class LatencyAwareRouter(SequentialRouter):
    name = "latency-aware"

    def __init__(self, ctx: RouterContext, delta: float = 0.05, robust: bool | None = None) -> None:
        super().__init__(ctx, robust)
        if not math.isfinite(delta) or delta < 0:
            raise ValueError(f"delta must be a finite number >= 0, got {delta}")
        self.delta = delta
        self._standalone: np.ndarray | None = None

    def _ttft(self, win: Window, i: int, k: int, out: Outcome) -> float:
        ahead = np.flatnonzero(out.assignment[:i] == k)
        if self._standalone is not None and not ahead.size:
            return float(self._standalone[i, k])
        rows = np.append(ahead, i)
        t = self.ctx.ttft_model.in_order_ms(
            win.views[k],
            win.prompt_tokens[rows],
            win.output_tokens[rows, k],
            win.column_prefix(k, rows),
        )
        return float(t[-1])

    def begin(self, win: Window) -> None:
        self._standalone = np.full((win.n, win.k), np.inf)
        for k in np.flatnonzero(win.usable & (win.capacity > 0)).tolist():
            rows = np.flatnonzero(win.fits[:, k])
            if rows.size:
                self._standalone[rows, k] = self.ctx.ttft_model.standalone_ms(
                    win.views[k],
                    win.prompt_tokens[rows],
                    win.output_tokens[rows, k],
                    win.column_prefix(k, rows, in_order=False),
                )

    def choose(
        self, win: Window, ledger: Ledger, i: int, candidates: np.ndarray, out: Outcome
    ) -> int:
        cols = np.flatnonzero(candidates)
        ttft = np.array([self._ttft(win, i, int(k), out) for k in cols])
        u = win.utility(self.robust, self.ctx.lam_per_usd)[i, cols]
        tau = float(win.slo_ms[i])
        ok = ttft <= tau
        if ok.any():
            score = np.where(ok, u - self.delta * ttft / tau, -np.inf)
            t = int(score.argmax())
        else:
            t = int(ttft.argmin())
            out.flags[i].append(DecisionFlag.SLO_INFEASIBLE)
            out.reasons[i] = f"no instance meets the {tau:g} ms TTFT SLO: lowest estimated TTFT"
        out.ttft_ms[i] = ttft[t]
        return int(cols[t])
