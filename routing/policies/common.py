"""Shared window preparation and decision building for every policy.

A window is n queries × K instance columns: predicted quality (mean and robust lower
bound) and output length per model expanded to the instances serving it, cost =
input price · prompt tokens + output price · predicted output tokens (capped by the
query's ``max_tokens``), less (input − cached-input price) · the pair's prefix-cache hit
(``ModelSpec.cached_input_usd_per_token``; prefix-aware windows only), free slots per
instance, and the budget as rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from routing.policies.context import DEFAULT_OUTPUT_TOKENS, RouterContext
from routing.prefix import ColumnPrefix, WindowPrefixes
from routing.types import Budget, FloatArray, InstanceView, IntArray
from schemas import (
    Decision,
    DecisionFlag,
    DecisionStatus,
    Query,
    WindowStats,
    trusted_decisions,
)

BoolArray = npt.NDArray[np.bool_]


@dataclass
class Window:
    queries: Sequence[Query]
    views: Sequence[InstanceView]
    prompt_tokens: IntArray  # [n]
    slo_ms: FloatArray  # [n]
    quality_mean: FloatArray  # [n, K]
    quality_lower: FloatArray  # [n, K]
    output_tokens: IntArray  # [n, K]
    cost_usd: FloatArray  # [n, K]
    usable: BoolArray  # [K] instance known to the cluster and the predictor
    capacity: IntArray  # [K] free slots (0 where not usable)
    estimate: BoolArray  # [K] TTFT from LPS (no live state)
    stale: BoolArray  # [K]
    fits: BoolArray  # [n, K] prompt + output cap within the instance's context (and KV cache)
    unfit: list[str | None]  # [n] why no instance in view can hold the query (None: one can)
    never_fits: BoolArray  # [n] no model of the cluster can hold it at all: rejected
    hit_tokens: IntArray  # [n, K] prompt tokens cached on each instance (routing.prefix)
    warm_parent: IntArray  # [n] earlier query sharing the longest prefix (-1: none)
    warm_tokens: IntArray  # [n] tokens of that shared prefix
    prefixes: WindowPrefixes | None = None  # the queries' block hashes (prefix-aware only)
    started: float = field(default_factory=time.perf_counter)

    @property
    def n(self) -> int:
        return len(self.queries)

    @property
    def k(self) -> int:
        return len(self.views)

    def utility(self, robust: bool, lam_per_usd: float) -> FloatArray:
        a = self.quality_lower if robust else self.quality_mean
        out: FloatArray = a - lam_per_usd * self.cost_usd if lam_per_usd > 0 else a.copy()
        return out

    def column_prefix(self, k: int, rows: IntArray, in_order: bool = True) -> ColumnPrefix | None:
        """The prefix facts of ``rows`` (in order) on instance ``k``, for SFS; None when
        nothing is cached or shared."""
        if self.prefixes is None:
            return None
        hits = self.hit_tokens[rows, k]
        if not self.prefixes.shares_any and not hits.any():
            return None  # no hit and no pair sharing a block: the matrix below is all zero
        shared = self.prefixes.shared_matrix(rows) if in_order and rows.size > 1 else None
        if not hits.any() and (shared is None or not shared.any()):
            return None
        return ColumnPrefix(hits, shared, self.prefixes.block_tokens[rows])

    def columns(self, i: int) -> BoolArray:
        """Instances that may take query ``i`` at all: usable and able to hold it."""
        out: BoolArray = self.usable & self.fits[i]
        return out

    def ttft_flags(self, k: int) -> list[DecisionFlag]:
        flags: list[DecisionFlag] = []
        if self.estimate[k]:
            flags.append(DecisionFlag.LPS_ESTIMATE)
        if self.stale[k]:
            flags.append(DecisionFlag.STALE_STATE)
        return flags


def remaining_slo_ms(q: Query, now: float) -> float:
    """``ttft_slo_ms`` less the time since ``created_at`` (same clock as ``now``), >= 0."""
    if q.created_at is None or now <= q.created_at:
        return q.ttft_slo_ms
    return max(0.0, q.ttft_slo_ms - (now - q.created_at) * 1000.0)


def prepare(
    ctx: RouterContext, queries: Sequence[Query], views: Sequence[InstanceView], now: float
) -> Window:
    """Predict quality, length and cost for every (query, instance).

    The SLO each pair is checked against is what is left of it at ``now``: a query that
    waited in its window (or was held for a free slot) since ``created_at`` has that much
    less time for its first token.
    """
    started = time.perf_counter()
    n, K = len(queries), len(views)
    texts = [q.text() for q in queries]
    prompt = np.fromiter((q.estimated_prompt_tokens() for q in queries), np.int64, n)
    slo = np.fromiter((remaining_slo_ms(q, now) for q in queries), np.float64, n)
    qmodels = list(ctx.quality.models)
    col_of = {name: j for j, name in enumerate(qmodels)}
    key_of = ctx.predictor_keys  # ModelSpec.quality_as
    usable = np.array([key_of.get(v.model) in col_of for v in views], dtype=np.bool_)
    cols = np.array([col_of.get(key_of.get(v.model, v.model), 0) for v in views], dtype=np.int64)
    if n and K:
        est = ctx.quality.predict(texts)
        mean_m = np.asarray(est.mean, dtype=np.float64)
        lower_m = np.asarray(est.lower, dtype=np.float64)
        if mean_m.shape != (n, len(qmodels)) or lower_m.shape != mean_m.shape:
            raise ValueError(
                f"quality predictor returned shapes {mean_m.shape}/{lower_m.shape}, "
                f"expected {(n, len(qmodels))}"
            )
        if not (np.isfinite(mean_m).all() and np.isfinite(lower_m).all()):
            raise ValueError("quality predictor returned NaN or inf quality")
        mean = mean_m[:, cols]
        lower = lower_m[:, cols]
    else:
        mean = np.zeros((n, K))
        lower = np.zeros((n, K))
    out_tokens = _output_tokens(ctx, texts, prompt, queries, views)
    in_price = np.zeros(K)
    out_price = np.zeros(K)
    cached_price = np.zeros(K)
    for j, v in enumerate(views):
        if usable[j]:
            spec = ctx.cluster.model(v.model)
            in_price[j] = spec.input_usd_per_token
            out_price[j] = spec.output_usd_per_token
            cached_price[j] = spec.cached_input_price
    cost = prompt[:, None] * in_price[None, :] + out_tokens * out_price[None, :]
    capacity = np.array([max(0, int(v.free_slots)) for v in views], dtype=np.int64)
    capacity = np.where(usable, capacity, 0)
    ttft = ctx.ttft_model
    estimate = np.array([ttft.is_estimate(v) for v in views], dtype=np.bool_)
    stale = np.array([bool(v.stale) for v in views], dtype=np.bool_)
    fits, unfit, never = context_fits(ctx, queries, prompt, views, usable)
    prefixes, hits, parent, shared = prefix_hits(ctx, queries, prompt, views, usable)
    # a hit is billed at the cached-input price: where a query's prefix is cached is cheaper
    cost = cost - hits * (in_price - cached_price)[None, :]
    return Window(
        queries,
        views,
        prompt,
        slo,
        mean,
        lower,
        out_tokens,
        cost,
        usable,
        capacity,
        estimate,
        stale,
        fits,
        unfit,
        never,
        hits,
        parent,
        shared,
        prefixes,
        started,
    )


def prefix_hits(
    ctx: RouterContext,
    queries: Sequence[Query],
    prompt: IntArray,
    views: Sequence[InstanceView],
    usable: BoolArray,
) -> tuple[WindowPrefixes | None, IntArray, IntArray, IntArray]:
    """Each query's prefix-cache hit on each instance, and the earlier query of the window
    it shares the longest prefix with (``routing.prefix``). Zeros when not prefix-aware."""
    n, K = len(queries), len(views)
    hits = np.zeros((n, K), dtype=np.int64)
    none = np.full(n, -1, dtype=np.int64)
    if not ctx.prefix_aware or n == 0:
        return None, hits, none, np.zeros(n, dtype=np.int64)
    wp = WindowPrefixes.of_queries(queries, prompt)
    for k, v in enumerate(views):
        if usable[k] and v.prefix_hashes is not None and v.prefix_hashes.size:
            hits[:, k] = wp.hit_tokens(v.prefix_hashes)
    parent, shared = wp.sharing()
    return wp, hits, parent, shared


def context_fits(
    ctx: RouterContext,
    queries: Sequence[Query],
    prompt: IntArray,
    views: Sequence[InstanceView],
    usable: BoolArray,
) -> tuple[BoolArray, list[str | None], BoolArray]:
    """Which instances can hold each query: prompt + output cap <= the model's context.

    The output cap is the query's own (``max_tokens``), else the model's
    ``max_output_tokens`` cut to what the context leaves after the prompt
    (``ModelSpec.default_output_cap_tokens``) — what the worker sends the engine, which refuses a request
    whose prompt plus cap exceeds ``max_model_len`` (and no request may outgrow the KV
    cache: ``ModelSpec.context_tokens``). Returns the ``[n, K]`` mask, a reason per query
    that fits no instance in view, and which of those fit no model of the cluster at all
    (rejected: waiting cannot help; the others are deferred until a model that can
    hold them has a live instance).
    """
    n, K = len(queries), len(views)
    qcap = np.fromiter((q.output_cap_tokens() or 0 for q in queries), np.int64, n)
    specs = list(ctx.cluster.models)
    limit_m = np.array([s.context_tokens() for s in specs], dtype=np.int64)
    default_m = np.array([s.max_output_tokens for s in specs], dtype=np.int64)
    # no own cap: the model's default cut to what the context leaves (>= 1 token), as
    # ModelSpec.default_output_cap_tokens — such a query fits when its prompt leaves room
    default_cap = np.maximum(1, np.minimum(default_m[None, :], limit_m[None, :] - prompt[:, None]))
    need_m = prompt[:, None] + np.where(qcap[:, None] > 0, qcap[:, None], default_cap)
    fits_m = need_m <= limit_m[None, :]
    index = {s.name: m for m, s in enumerate(specs)}
    cols = np.array([index.get(v.model, -1) for v in views], dtype=np.int64)
    fits: BoolArray = np.zeros((n, K), dtype=np.bool_)
    known = cols >= 0
    if n and known.any():
        fits[:, known] = fits_m[:, cols[known]]
    fits &= usable[None, :]
    never: BoolArray = np.asarray(~fits_m.any(axis=1), dtype=np.bool_)
    unfit: list[str | None] = [None] * n
    for i in np.flatnonzero(~fits.any(axis=1)).tolist() if K else range(n):
        cap = int(need_m[i].min() - prompt[i]) if qcap[i] == 0 else int(qcap[i])
        if never[i]:
            m = int(limit_m.argmax())
            unfit[i] = (
                f"prompt of {int(prompt[i])} tokens + output cap of {cap} tokens exceeds the "
                f"context of every model (largest: {int(limit_m[m])} tokens, {specs[m].name})"
            )
        else:
            names = sorted(specs[m].name for m in np.flatnonzero(fits_m[i]).tolist())
            unfit[i] = (
                f"prompt of {int(prompt[i])} tokens + output cap of {cap} tokens fits only "
                f"model(s) {', '.join(names)}, with no usable live instance in this window"
            )
    return fits, unfit, never


def mark_unfit(win: Window, out: Outcome) -> None:
    """Queries no instance in view can hold: rejected when no model of the cluster ever
    could, else deferred (with the reason either way)."""
    for i, why in enumerate(win.unfit):
        if why is None:
            continue
        out.reasons[i] = why
        if win.never_fits[i]:
            out.status[i] = DecisionStatus.REJECTED


def _output_tokens(
    ctx: RouterContext,
    texts: list[str],
    prompt: IntArray,
    queries: Sequence[Query],
    views: Sequence[InstanceView],
) -> IntArray:
    n, K = len(queries), len(views)
    out = np.full((n, K), DEFAULT_OUTPUT_TOKENS)
    if n == 0 or K == 0:
        return out.astype(np.int64)
    by_model: dict[str, FloatArray] = {}
    if ctx.length is not None:
        lm = list(ctx.length.models)
        pred = np.asarray(ctx.length.predict(texts, prompt), dtype=np.float64)
        if pred.shape != (n, len(lm)):
            raise ValueError(
                f"length predictor returned shape {pred.shape}, expected {(n, len(lm))}"
            )
        by_model = {name: pred[:, j] for j, name in enumerate(lm)}
    key_of = ctx.predictor_keys
    for j, v in enumerate(views):
        key = key_of.get(v.model, v.model)
        if key in by_model:
            out[:, j] = by_model[key]
        else:
            try:
                mean = ctx.cluster.model(v.model).mean_output_tokens
            except KeyError:
                mean = None
            out[:, j] = mean if mean is not None else DEFAULT_OUTPUT_TOKENS
    out = np.where(np.isfinite(out), out, DEFAULT_OUTPUT_TOKENS)
    cap = np.array([q.output_cap_tokens() or 0 for q in queries], dtype=np.float64)
    out = np.where(cap[:, None] > 0, np.minimum(out, cap[:, None]), out)
    result: IntArray = np.maximum(np.rint(out), 1).astype(np.int64)
    return result


def budget_groups(queries: Sequence[Query], budget: Budget) -> tuple[IntArray, FloatArray]:
    """Per-query tenant row index (-1: tenant without a remaining-budget row)."""
    tenants = sorted({q.tenant for q in queries if q.tenant in budget.tenant_remaining_usd})
    idx = {t: g for g, t in enumerate(tenants)}
    group = np.array([idx.get(q.tenant, -1) for q in queries], dtype=np.int64)
    limits = np.array([budget.tenant_remaining_usd[t] for t in tenants], dtype=np.float64)
    return group, limits


class Ledger:
    """Capacity and money left while a per-query policy walks the window in order."""

    def __init__(self, win: Window, budget: Budget) -> None:
        self.win = win
        self.free = win.capacity.copy()
        self.left = float(budget.window_usd)
        self.group, self.group_left = budget_groups(win.queries, budget)
        self.group_left = self.group_left.copy()

    def room(self) -> BoolArray:
        out: BoolArray = self.win.usable & (self.free > 0)
        return out

    def affordable(self, i: int) -> BoolArray:
        limit = self.left
        g = int(self.group[i])
        if g >= 0:
            limit = min(limit, float(self.group_left[g]))
        out: BoolArray = self.win.cost_usd[i] <= limit + 1e-15
        return out

    def take(self, i: int, k: int) -> None:
        self.free[k] -= 1
        c = float(self.win.cost_usd[i, k])
        self.left -= c
        g = int(self.group[i])
        if g >= 0:
            self.group_left[g] -= c


@dataclass
class Outcome:
    """A policy's answer before it becomes ``Decision`` objects."""

    assignment: IntArray  # [n] instance column, -1 deferred
    status: list[DecisionStatus]
    flags: list[list[DecisionFlag]]
    reasons: list[str | None]
    ttft_ms: FloatArray  # [n] predicted TTFT of routed queries (nan otherwise)
    solver: str
    objective: float
    bound: float
    gap: float = 0.0
    budget_dual: float = 0.0
    ttft_rounds: int = 0

    @classmethod
    def empty(cls, n: int, solver: str) -> Outcome:
        return cls(
            np.full(n, -1, dtype=np.int64),
            [DecisionStatus.DEFERRED] * n,
            [[] for _ in range(n)],
            [None] * n,
            np.full(n, np.nan),
            solver,
            0.0,
            0.0,
        )


def predict_ttft_in_order(ctx: RouterContext, win: Window, assignment: IntArray) -> FloatArray:
    """SFS TTFT of every routed query with all of its instance's new queries in order."""
    ttft = np.full(win.n, np.nan)
    for k in np.unique(assignment[assignment >= 0]).tolist():
        rows = np.flatnonzero(assignment == k)
        ttft[rows] = ctx.ttft_model.in_order_ms(
            win.views[k],
            win.prompt_tokens[rows],
            win.output_tokens[rows, k],
            win.column_prefix(k, rows),
        )
    return ttft


def overspend(win: Window, out: Outcome, budget: Budget, reason: str) -> None:
    """With ``allow_overspend``, route budget-deferred queries to their cheapest instance."""
    if not budget.allow_overspend:
        return
    free = win.capacity - np.bincount(out.assignment[out.assignment >= 0], minlength=win.k)
    for i in np.flatnonzero(out.assignment < 0).tolist():
        if not (win.usable & (free > 0)).any():
            break
        room = win.columns(i) & (free > 0)
        if not room.any():
            continue  # no instance with a slot can hold this one
        k = int(np.where(room, win.cost_usd[i], np.inf).argmin())
        out.assignment[i] = k
        free[k] -= 1
        out.status[i] = DecisionStatus.OVER_BUDGET
        out.reasons[i] = reason
        out.flags[i] = [f for f in out.flags[i] if f != DecisionFlag.BUDGET_DEFERRED]


# the two shapes of ``decisions``' values (each dict below has exactly these fields)
_unrouted = trusted_decisions(
    ("query_id", "tenant", "status", "policy", "flags", "decided_at", "reason", "window")
)
_routed = trusted_decisions(
    ("query_id", "tenant", "status", "instance_id", "model", "policy", "flags",
     "predicted_quality", "predicted_quality_lb", "predicted_cost_usd", "predicted_ttft_ms",
     "predicted_output_tokens", "decided_at", "reason", "window")
)  # fmt: skip


def decisions(
    policy: str,
    win: Window,
    out: Outcome,
    budget: Budget,
    now: float,
    robust: bool,
) -> list[Decision]:
    """Turn an outcome into one ``Decision`` per query, with the window's solver figures.

    The decisions are built unvalidated (``schemas.trusted_decisions``) from the window's
    arrays, read once as Python values: every value is of its field's type and within its
    bounds by construction (costs clipped at 0, TTFTs kept only when finite and >= 0)."""
    assignment = out.assignment.tolist()
    rows = [i for i, k in enumerate(assignment) if k >= 0]
    cols = [assignment[i] for i in rows]
    # summed in order from 0, as ``sum`` over the routed pairs one by one
    spend = float(sum(win.cost_usd[rows, cols].tolist()))
    first = win.queries[0].id if win.n else "empty"
    stats = WindowStats(
        window_id=f"{policy}:{now:.6f}:{first}",
        n_queries=win.n,
        solver=out.solver,
        objective=float(out.objective),
        lp_bound=float(max(out.bound, out.objective)),
        gap=float(max(out.gap, 0.0)),
        budget_dual=float(out.budget_dual),
        budget_usd=float(budget.window_usd),
        spend_usd=spend,
        decide_ms=max(0.0, (time.perf_counter() - win.started) * 1e3),
        ttft_rounds=out.ttft_rounds,
    )
    decided_at = max(0.0, float(now))
    mean = win.quality_mean[rows, cols].tolist()
    lower = win.quality_lower[rows, cols].tolist()
    cost = [c if c > 0.0 else 0.0 for c in win.cost_usd[rows, cols].tolist()]  # max(0.0, c)
    ttft = out.ttft_ms[rows].tolist()
    tokens = win.output_tokens[rows, cols].tolist()
    col_flags = [win.ttft_flags(k) for k in range(win.k)]
    ids = [(v.instance_id, v.model) for v in win.views]
    routed = dict(zip(rows, range(len(rows)), strict=True))
    no_reason = "no instance" if win.k == 0 else "no free slot or budget left in this window"
    result: list[Decision] = []
    for i, q in enumerate(win.queries):
        status = out.status[i]
        j = routed.get(i)
        if j is None:
            if status == DecisionStatus.ROUTED:
                status = DecisionStatus.DEFERRED
            result.append(
                _unrouted(
                    {
                        "query_id": q.id,
                        "tenant": q.tenant,
                        "status": status,
                        "policy": policy,
                        "flags": list(out.flags[i]),
                        "decided_at": decided_at,
                        "reason": out.reasons[i] or no_reason,
                        "window": stats,
                    }
                )
            )
            continue
        k = cols[j]
        flags = list(out.flags[i])
        if flags:
            flags.extend(f for f in col_flags[k] if f not in flags)
        else:
            flags = list(col_flags[k])  # distinct flags already
        t = ttft[j]
        result.append(
            _routed(
                {
                    "query_id": q.id,
                    "tenant": q.tenant,
                    "status": status,
                    "instance_id": ids[k][0],
                    "model": ids[k][1],
                    "policy": policy,
                    "flags": flags,
                    "predicted_quality": mean[j],
                    "predicted_quality_lb": lower[j],
                    "predicted_cost_usd": cost[j],
                    "predicted_ttft_ms": t if math.isfinite(t) and t >= 0 else None,
                    "predicted_output_tokens": tokens[j],
                    "decided_at": decided_at,
                    "reason": out.reasons[i],
                    "window": stats,
                }
            )
        )
    return result


def rejected(
    policy: str, queries: Sequence[Query], budget: Budget, now: float, reason: str
) -> list[Decision]:
    stats = WindowStats(
        window_id=f"{policy}:{now:.6f}:{queries[0].id if queries else 'empty'}",
        n_queries=len(queries),
        solver=policy,
        objective=0.0,
        lp_bound=0.0,
        gap=0.0,
        budget_usd=float(budget.window_usd),
        spend_usd=0.0,
        decide_ms=0.0,
    )
    return [
        Decision(
            query_id=q.id,
            tenant=q.tenant,
            status=DecisionStatus.REJECTED,
            policy=policy,
            decided_at=max(0.0, float(now)),
            reason=reason,
            window=stats,
        )
        for q in queries
    ]
