"""Run a routing policy over traffic in virtual time, the way the service does, and score it.

Batching is the stream processor's ``take(max_batch, within=window_s)``: a window opens at
the first arrival after the previous flush and closes ``window_s`` later, or as soon as it
holds ``max_batch`` queries. As in ``streams/service.py``, a query that cannot be placed
(every instance full, or deferred by the router) is *held*: it joins the next window
(held queries first, a retry window every ``window_s`` while any are held) until
``max_hold_s`` (``budget_hold_s`` for budget deferrals) has passed since the window that
first saw it, then it is finally
deferred; with no free slot anywhere the router is not asked at all; load shedding, when
configured, gives up queries that waited too long or overflow the backlog first. Those rules
(shedding, admission, the batch cut, hold or give up) are ``routing.window``'s, the same functions
the service calls. At the close the cluster is advanced to that instant, the SAME
``Router`` object the service uses decides the whole window on the instances' live views
and the window's ``Budget``, and routed queries enter their instances right then (plus the
measured decision time when ``charge_decision_time`` is set: off by default, so results
are deterministic for a seed).

Metrics (paper A, "Metric: OnTimeUtility"; paper B for spend):

- utility of query i on model j: ``u = score_ij − λ·cost_ij`` (``utility_lambda``: quality
  per USD), its realised cost billing the prompt tokens its engine found in the prefix cache
  at the model's cached-input price (``ModelSpec.cached_input_usd_per_token``; each window's
  spend, checked against its budget, is counted at routing time at the full input price);
- OnTimeUtility: mean over ALL queries of u when TTFT ≤ SLO, else min(u, 0) (a late answer
  is worth nothing but its money is still spent; equal to the paper's 0 whenever u ≥ 0), so
  OnTimeUtility ≤ mean utility always; deferred queries count 0 and as SLO misses;
- SLO attainment, mean realised quality, realised spend vs budget with every window whose
  realised spend broke its budget, TTFT p50/p99 (from the user's send time, so the wait in
  the window counts), decision time per window p50/p99 (wall clock: the only use of it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.types import Budget, Router
from routing.window import (
    BUDGET_HOLD_S,
    MAX_BATCH,
    MAX_HOLD_S,
    SHED_AFTER_SLO,
    SHED_BACKLOG,
    UNLIMITED_USD,
    HoldReason,
    WindowSettings,
    admit,
    settle,
    shed,
)
from schemas import Decision, DecisionStatus
from sim.cluster import SimCluster
from sim.traffic import Workload

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ROUTED, DEFERRED, REJECTED, OVER_BUDGET = 0, 1, 2, 3
_STATUS = {
    DecisionStatus.ROUTED: ROUTED,
    DecisionStatus.DEFERRED: DEFERRED,
    DecisionStatus.REJECTED: REJECTED,
    DecisionStatus.OVER_BUDGET: OVER_BUDGET,
}


class EvaluationError(RuntimeError):
    """A router broke the contract (missing, duplicate or unknown decisions)."""


@dataclass(frozen=True)
class EvalConfig:
    """How the service batches and budgets, and how utility is priced."""

    window_s: float = 0.05
    max_batch: int = MAX_BATCH
    budget_usd_per_query: float | None = None  # window budget = this × queries in the window
    carry_over: bool = False  # unspent window budget rolls into the next window
    total_budget_usd: float | None = None  # the tenant's budget for the whole run
    utility_lambda: float = 0.0  # quality per USD in u = score − λ·cost
    charge_decision_time: bool = False
    max_tokens: int | None = None
    max_hold_s: float = MAX_HOLD_S  # a query waiting for capacity gives up after this
    budget_hold_s: float = BUDGET_HOLD_S  # a query deferred for budget gives up after this
    shed_backlog: int = SHED_BACKLOG  # load shedding past this many waiting queries; 0: off
    shed_after_slo: float = SHED_AFTER_SLO  # shed after waiting this × TTFT SLO; 0: off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s >= 0):
            raise ValueError(f"EvalConfig.window_s must be finite and >= 0, got {self.window_s}")
        if self.max_batch < 1:
            raise ValueError(f"EvalConfig.max_batch must be >= 1, got {self.max_batch}")
        for name in ("budget_usd_per_query", "total_budget_usd"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"EvalConfig.{name} must be finite and >= 0, got {v}")
        if not (math.isfinite(self.utility_lambda) and self.utility_lambda >= 0):
            raise ValueError(
                f"EvalConfig.utility_lambda must be finite and >= 0, got {self.utility_lambda}"
            )

    @property
    def window(self) -> WindowSettings:
        """The window rules' settings (``routing.window``)."""
        return WindowSettings.of(self)


@dataclass(frozen=True)
class Breach:
    """A window whose realised spend broke its budget."""

    window: int
    t_s: float
    budget_usd: float
    spend_usd: float
    predicted_spend_usd: float


@dataclass
class EvalResult:
    """Per-query outcomes (arrays) and per-window figures of one run."""

    policy: str
    n: int
    status: IntArray  # [n] ROUTED / DEFERRED / REJECTED / OVER_BUDGET
    instance: IntArray  # [n] index into instance_ids, -1 if not served
    model: IntArray  # [n] index into models, -1 if not served
    score: FloatArray  # [n] realised score (0 if not served)
    cost_usd: FloatArray  # [n] realised cost (0 if not served)
    predicted_cost_usd: FloatArray  # [n]
    ttft_ms: FloatArray  # [n] nan if not served
    slo_ms: FloatArray  # [n]
    prompt_tokens: IntArray  # [n]
    cached_tokens: IntArray  # [n] prompt tokens its engine found in the prefix cache
    decided: IntArray  # [n] how many decisions each query got (must be 1)
    completed: IntArray  # [n] how many completions each query got (1 if served)
    window_budget_usd: FloatArray  # [w]
    window_spend_usd: FloatArray  # [w]
    window_size: IntArray  # [w]
    decide_ms: FloatArray  # [w]
    breaches: list[Breach]
    instance_ids: list[str]
    models: list[str]
    utility_lambda: float
    sim_wall_s: float
    flags: dict[str, int] = field(default_factory=dict)

    # --------------------------------------------------------------- metrics
    @property
    def served(self) -> npt.NDArray[np.bool_]:
        return (self.status == ROUTED) | (self.status == OVER_BUDGET)

    @property
    def on_time(self) -> npt.NDArray[np.bool_]:
        t = np.where(np.isnan(self.ttft_ms), np.inf, self.ttft_ms)
        return self.served & (t <= self.slo_ms)

    @property
    def utility(self) -> FloatArray:
        out: FloatArray = np.where(
            self.served, self.score - self.utility_lambda * self.cost_usd, 0.0
        )
        return out

    @property
    def ontime_utility(self) -> float:
        u = self.utility
        return float(np.where(self.on_time, u, np.minimum(u, 0.0)).mean()) if self.n else 0.0

    @property
    def mean_utility(self) -> float:
        return float(self.utility.mean()) if self.n else 0.0

    @property
    def slo_attainment(self) -> float:
        return float(self.on_time.mean()) if self.n else 0.0

    @property
    def mean_quality(self) -> float:
        return float(self.score.mean()) if self.n else 0.0

    @property
    def spend_usd(self) -> float:
        return float(self.cost_usd.sum())

    @property
    def budget_usd(self) -> float:
        return float(self.window_budget_usd.sum())

    def ttft_percentile_ms(self, q: float) -> float:
        t = self.ttft_ms[~np.isnan(self.ttft_ms)]
        return float(np.percentile(t, q)) if t.size else float("nan")

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens served from engines' prefix caches / prompt tokens of served queries
        (vLLM's prefix_cache_hits_total / prefix_cache_queries_total)."""
        total = float(self.prompt_tokens[self.served].sum())
        return float(self.cached_tokens[self.served].sum()) / total if total else 0.0

    def decide_percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.decide_ms, q)) if self.decide_ms.size else float("nan")

    def summary(self) -> dict[str, Any]:
        """Every headline figure, JSON-ready."""
        limited = (
            bool(np.all(self.window_budget_usd < UNLIMITED_USD / 10))
            if self.window_budget_usd.size
            else False
        )
        share = np.bincount(self.model[self.model >= 0], minlength=len(self.models)) / max(
            self.n, 1
        )
        return {
            "policy": self.policy,
            "queries": self.n,
            "routed": int(self.served.sum()),
            "deferred": int((self.status == DEFERRED).sum()),
            "ontime_utility": self.ontime_utility,
            "mean_utility": self.mean_utility,
            "slo_attainment": self.slo_attainment,
            "mean_quality": self.mean_quality,
            "spend_usd": self.spend_usd,
            "budget_usd": self.budget_usd if limited else None,
            "budget_breaches": len(self.breaches),
            "worst_breach_usd": max(
                (b.spend_usd - b.budget_usd for b in self.breaches), default=0.0
            ),
            "ttft_p50_ms": self.ttft_percentile_ms(50),
            "ttft_p99_ms": self.ttft_percentile_ms(99),
            "cache_hit_rate": self.cache_hit_rate,
            "decide_p50_ms": self.decide_percentile_ms(50),
            "decide_p99_ms": self.decide_percentile_ms(99),
            "windows": int(self.window_size.size),
            "sim_wall_s": self.sim_wall_s,
            "model_share": {m: float(s) for m, s in zip(self.models, share, strict=True) if s > 0},
            "flags": dict(self.flags),
        }


def _prices(cluster: SimCluster, models: Sequence[str]) -> tuple[FloatArray, FloatArray]:
    """Per-token prices of the workload's models (0 for models the cluster does not serve:
    nothing can be routed there)."""
    specs = cluster.specs
    pin = np.array([specs[m].input_usd_per_token if m in specs else 0.0 for m in models])
    pout = np.array([specs[m].output_usd_per_token if m in specs else 0.0 for m in models])
    return pin, pout


def evaluate(
    router: Router,
    cluster: SimCluster,
    workload: Workload,
    config: EvalConfig = EvalConfig(),
    *,
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Run ``router`` over ``workload`` on ``cluster`` (which must be fresh) and score it."""
    n = workload.n
    cols = {m: j for j, m in enumerate(workload.models)}
    missing = [m for m in set(cluster.models) if m not in cols]
    if missing:
        raise EvaluationError(
            f"cluster models {sorted(missing)} have no scores in the workload (it has {workload.models})"
        )
    inst_index = {iid: k for k, iid in enumerate(cluster.instance_ids)}
    inst_model_col = np.array([cols[m] for m in cluster.models], dtype=np.int64)
    pin, pout = _prices(cluster, workload.models)
    specs = cluster.specs
    cached_discount = np.array(
        [pin[j] - specs[m].cached_input_price if m in specs else 0.0
         for j, m in enumerate(workload.models)]
    )  # fmt: skip
    row_of = {workload.query_id(i): i for i in range(n)}

    status = np.full(n, -1, dtype=np.int64)
    instance = np.full(n, -1, dtype=np.int64)
    model = np.full(n, -1, dtype=np.int64)
    cost = np.zeros(n)
    pred_cost = np.zeros(n)
    ttft = np.full(n, np.nan)
    cached = np.zeros(n, dtype=np.int64)
    decided = np.zeros(n, dtype=np.int64)
    completed = np.zeros(n, dtype=np.int64)
    held_windows = np.zeros(n, dtype=np.int64)
    first_seen = np.full(n, np.nan)  # virtual time of the window a query first joined
    w_budget: list[float] = []
    w_spend: list[float] = []
    w_size: list[int] = []
    w_ms: list[float] = []
    breaches: list[Breach] = []
    flags: dict[str, int] = {}

    def record(done: Sequence[Any]) -> None:
        for c in done:
            i = row_of.get(c.request_id)
            if i is None:
                raise EvaluationError(f"completion for unknown request {c.request_id!r}")
            completed[i] += 1
            cached[i] = c.cached_tokens
            # what the engine found cached is billed at the cached-input price
            cost[i] -= cached_discount[int(model[i])] * c.cached_tokens if model[i] >= 0 else 0.0
            if c.error:  # the engine refused it: not served
                status[i] = REJECTED
                flags["engine_rejected"] = flags.get("engine_rejected", 0) + 1
                continue
            ttft[i] = c.ttft_ms

    def give_up(k: int) -> None:
        decided[k] += 1
        status[k] = DEFERRED

    arrivals = workload.arrival_s
    rules = config.window
    allowance = 0.0
    reserved_total = 0.0
    t_free = 0.0  # when the router is free again (only matters with charge_decision_time)
    started = time.perf_counter()
    held: list[int] = []  # the service's held queries: oldest first
    last_close = -math.inf
    i = 0
    while i < n or held:
        if held:
            # the service's retry timer: held queries get a window every window_s
            close_t = max(last_close + max(config.window_s, 0.05), cluster.now)
            if i < n and float(arrivals[i]) + config.window_s < close_t:
                close_t = float(arrivals[i]) + config.window_s
        else:
            close_t = float(arrivals[i]) + config.window_s
        end = int(np.searchsorted(arrivals, close_t, side="right"))
        if end - i >= config.max_batch:
            end = i + config.max_batch
            close_t = max(float(arrivals[end - 1]), close_t if held else float(arrivals[end - 1]))
        now = max(close_t, t_free, cluster.now)
        last_close = now
        record(cluster.advance_to(now))
        fresh = list(range(i, end))
        i = end
        first_seen[fresh] = now  # the service counts a hold from the window it first saw
        views = cluster.views()
        shedding = shed(
            held + fresh, arrivals[held + fresh], workload.slo_ms[held + fresh] / 1000.0, now, rules
        )
        for g in shedding.shed:
            decided[g.item] += 1
            status[g.item] = _STATUS[g.status]
        if shedding.shed:
            flags["shed"] = flags.get("shed", 0) + len(shedding.shed)
        admission = admit(
            shedding.kept,
            [float(first_seen[k]) for k in shedding.kept],
            [v.free_slots for v in views],
            now,
            rules,
        )
        held = [h.item for h in admission.held]
        for h in admission.held:
            if h.reason != HoldReason.OVERFLOW:
                held_windows[h.item] += 1
        for g in admission.given_up:
            give_up(g.item)
        candidates = admission.asked
        if not candidates:
            held.sort()
            if progress is not None:
                progress(i - len(held), n)
            continue
        queries = [workload.query(k, config.max_tokens) for k in candidates]
        asked = dict(zip(candidates, queries, strict=True))
        if config.budget_usd_per_query is None:
            window_usd = UNLIMITED_USD
        else:
            allowance = (
                allowance if config.carry_over else 0.0
            ) + config.budget_usd_per_query * len(candidates)
            window_usd = allowance
        tenants = {}
        if config.total_budget_usd is not None:
            tenants = {workload.tenant: max(0.0, config.total_budget_usd - reserved_total)}
        budget = Budget(window_usd=window_usd, tenant_remaining_usd=tenants)
        t0 = time.perf_counter()
        decisions = router.decide(queries, views, budget, now)
        dt_ms = (time.perf_counter() - t0) * 1000.0
        submit_t = now + dt_ms / 1000.0 if config.charge_decision_time else now
        if config.charge_decision_time:
            t_free = submit_t
            record(cluster.advance_to(submit_t))
        if len(decisions) != len(queries):
            raise EvaluationError(
                f"router {router.name!r} returned {len(decisions)} decisions for a window of {len(queries)} queries"
            )
        allowed = set(candidates)
        seen: set[int] = set()
        order: list[int] = []
        for d in decisions:
            k = _check_decision(d, row_of, allowed, router.name)
            if k in seen:
                raise EvaluationError(
                    f"router {router.name!r} decided query {d.query_id} twice in one window"
                )
            seen.add(k)
            order.append(k)
            if d.status not in _STATUS:
                raise EvaluationError(
                    f"router {router.name!r}: query {d.query_id}: unknown status {d.status!r}"
                )
            if _STATUS[d.status] in (ROUTED, OVER_BUDGET) and d.instance_id not in inst_index:
                raise EvaluationError(
                    f"router {router.name!r}: query {d.query_id} routed to unknown instance {d.instance_id!r}"
                )
            for f in d.flags:
                flags[str(f)] = flags.get(str(f), 0) + 1
        plan = settle(order, [float(first_seen[k]) for k in order], decisions, now, rules)
        for h in plan.held:
            held.append(h.item)  # the service holds it for the next window
            held_windows[h.item] += 1
        for g in plan.given_up:
            decided[g.item] += 1
            status[g.item] = _STATUS[g.status]
        spend = 0.0
        pspend = 0.0
        for k, d in plan.routed:
            decided[k] += 1
            status[k] = _STATUS[d.status]
            s = inst_index[str(d.instance_id)]
            j = int(inst_model_col[s])
            instance[k], model[k] = s, j
            out_tok = int(workload.output_tokens[k, j])
            cost[k] = pin[j] * workload.prompt_tokens[k] + pout[j] * out_tok
            pred_cost[k] = d.predicted_cost_usd if d.predicted_cost_usd is not None else cost[k]
            spend += cost[k]
            pspend += pred_cost[k]
            pred_out = d.predicted_output_tokens if d.predicted_output_tokens else None
            hashes, block_tokens = asked[k].prefix_blocks()
            cluster.submit(
                d.query_id,
                str(d.instance_id),
                float(arrivals[k]),
                int(workload.prompt_tokens[k]),
                out_tok,
                pred_out,
                prefix_hashes=hashes,
                prefix_block_tokens=block_tokens,
            )
        held.sort()
        reserved_total += spend
        if config.carry_over and config.budget_usd_per_query is not None:
            allowance -= spend
        if spend > window_usd * (1 + 1e-9) + 1e-15:
            breaches.append(Breach(len(w_budget), now, window_usd, spend, pspend))
        w_budget.append(window_usd)
        w_spend.append(spend)
        w_size.append(len(candidates))
        w_ms.append(dt_ms)
        if progress is not None:
            progress(i - len(held), n)
    record(cluster.drain())
    wall = time.perf_counter() - started
    if (decided != 1).any():
        bad = int(np.flatnonzero(decided != 1)[0])
        raise EvaluationError(
            f"query {workload.query_id(bad)} got {decided[bad]} final decisions, expected 1"
        )
    served = (status == ROUTED) | (status == OVER_BUDGET)
    scores = np.where(served, workload.scores[np.arange(n), np.maximum(model, 0)], 0.0)
    if held_windows.any():
        flags["held"] = int((held_windows > 0).sum())
    return EvalResult(
        policy=router.name,
        n=n,
        status=status,
        instance=instance,
        model=model,
        score=scores,
        cost_usd=cost,
        predicted_cost_usd=pred_cost,
        ttft_ms=ttft,
        slo_ms=workload.slo_ms.copy(),
        prompt_tokens=workload.prompt_tokens.copy(),
        cached_tokens=cached,
        decided=decided,
        completed=completed,
        window_budget_usd=np.asarray(w_budget),
        window_spend_usd=np.asarray(w_spend),
        window_size=np.asarray(w_size, dtype=np.int64),
        decide_ms=np.asarray(w_ms),
        breaches=breaches,
        instance_ids=list(cluster.instance_ids),
        models=list(workload.models),
        utility_lambda=config.utility_lambda,
        sim_wall_s=wall,
        flags=flags,
    )


def _check_decision(d: Decision, row_of: dict[str, int], allowed: set[int], policy: str) -> int:
    k = row_of.get(d.query_id)
    if k is None or k not in allowed:
        raise EvaluationError(
            f"router {policy!r} decided query {d.query_id!r}, which is not in this window"
        )
    return k
