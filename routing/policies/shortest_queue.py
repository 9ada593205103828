"""Shortest queue (paper A baseline): the instance with the fewest requests."""

from __future__ import annotations

import numpy as np

from routing.policies.base import SequentialRouter
from routing.policies.common import Ledger, Outcome, Window


class ShortestQueueRouter(SequentialRouter):
    """Fewest resident requests (live state, else occupied slots) plus this window's."""

    name = "shortest-queue"

    def choose(
        self, win: Window, ledger: Ledger, i: int, candidates: np.ndarray, out: Outcome
    ) -> int:
        load = np.empty(win.k)
        for k, v in enumerate(win.views):
            if v.state is not None:
                load[k] = v.state.n
            else:
                try:
                    load[k] = max(0, self.ctx.cluster.model(v.model).max_concurrency - v.free_slots)
                except KeyError:
                    load[k] = np.inf
        load += np.bincount(out.assignment[out.assignment >= 0], minlength=win.k)
        return int(np.where(candidates, load, np.inf).argmin())
