"""Round robin (paper A baseline): the next instance in turn with a free slot."""

from __future__ import annotations

import numpy as np

from routing.policies.base import SequentialRouter
from routing.policies.common import Ledger, Outcome, Window
from routing.policies.context import RouterContext


class RoundRobinRouter(SequentialRouter):
    """Cycles over instance ids; the turn is the router's only state."""

    name = "round-robin"

    def __init__(self, ctx: RouterContext) -> None:
        super().__init__(ctx)
        self._turn = 0

    def choose(
        self, win: Window, ledger: Ledger, i: int, candidates: np.ndarray, out: Outcome
    ) -> int:
        k = win.k
        order = (self._turn + np.arange(k)) % k
        pick = int(order[np.flatnonzero(candidates[order])[0]])
        self._turn = (pick + 1) % k
        return pick
