"""Latency-agnostic (paper A baseline): maximise utility a − λ·cost, ignore latency."""

from __future__ import annotations

import numpy as np

from routing.policies.base import SequentialRouter
from routing.policies.common import Ledger, Outcome, Window


class LatencyAgnosticRouter(SequentialRouter):
    name = "latency-agnostic"

    def choose(
        self, win: Window, ledger: Ledger, i: int, candidates: np.ndarray, out: Outcome
    ) -> int:
        u = win.utility(self.robust, self.ctx.lam_per_usd)[i]
        return int(np.where(candidates, u, -np.inf).argmax())
