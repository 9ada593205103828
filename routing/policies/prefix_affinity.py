"""Prefix affinity (baseline): what the serving routers do — llm-d's scorers, Dynamo's KV
router, SGLang's cache-aware router — a weighted sum of a prefix-match score and load:

    score_ij = w_prefix · hit_ij / prompt_i + w_queue · (1 − (load_j − min load) / (max − min))
               + w_kv · (1 − kv_used_j / kv_capacity_j)

``hit_ij``: prompt tokens of query i cached on instance j (its leading block hashes in j's
cache, plus what this window already sent there: the router's index is updated as it
routes, like llm-d's approximate prefix cache); ``load_j``: requests resident on j plus
those this window sent there. Defaults are llm-d's default profile (prefix 3, queue 2, no
KV term). Quality, money and SLOs are not looked at: the point of comparison for
``batch-ilp-sfs``, which weighs the same cache hits against all three.
"""

from __future__ import annotations

import math

import numpy as np

from routing.policies.base import SequentialRouter
from routing.policies.common import Ledger, Outcome, Window
from routing.policies.context import RouterContext


class PrefixAffinityRouter(SequentialRouter):
    name = "prefix-affinity"

    def __init__(
        self,
        ctx: RouterContext,
        w_prefix: float = 3.0,
        w_queue: float = 2.0,
        w_kv: float = 0.0,
    ) -> None:
        super().__init__(ctx)
        for name, w in (("w_prefix", w_prefix), ("w_queue", w_queue), ("w_kv", w_kv)):
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {w}")
        self.w_prefix, self.w_queue, self.w_kv = w_prefix, w_queue, w_kv
        self._load = np.zeros(0)
        self._kv_free = np.zeros(0)

    def begin(self, win: Window) -> None:
        load = np.empty(win.k)
        kv_free = np.ones(win.k)
        for k, v in enumerate(win.views):
            if v.state is not None:
                load[k] = v.state.n
                try:
                    sched = self.ctx.cluster.model(v.model).scheduler
                except KeyError:
                    continue
                cap = sched.kv_blocks * sched.block_size_tokens
                used = float((v.state.prefilled_tokens + v.state.decoded_tokens).sum())
                kv_free[k] = max(0.0, 1.0 - used / cap)
            else:
                try:
                    spec = self.ctx.cluster.model(v.model)
                    load[k] = max(0, spec.max_concurrency - v.free_slots)
                except KeyError:
                    load[k] = np.inf
        self._load, self._kv_free = load, kv_free

    def choose(
        self, win: Window, ledger: Ledger, i: int, candidates: np.ndarray, out: Outcome
    ) -> int:
        cols = np.flatnonzero(candidates)
        hit = win.hit_tokens[i, cols].astype(np.float64)
        parent = int(win.warm_parent[i])
        if parent >= 0 and out.assignment[parent] >= 0:
            # the window already sent a query sharing this prefix there: it will be cached
            same = cols == out.assignment[parent]
            hit = np.where(same, np.maximum(hit, float(win.warm_tokens[i])), hit)
        prefix = hit / max(float(win.prompt_tokens[i]), 1.0)
        load = self._load[cols] + np.bincount(
            out.assignment[out.assignment >= 0], minlength=win.k
        )[cols]
        spread = float(load.max() - load.min())
        queue = 1.0 - (load - load.min()) / spread if spread > 0 else np.ones(cols.size)
        score = self.w_prefix * prefix + self.w_queue * queue + self.w_kv * self._kv_free[cols]
        # ties: the least loaded, then the first
        best = np.flatnonzero(score >= score.max() - 1e-12)
        return int(cols[best[np.argmin(load[best])]])
