"""What a router sees, built from Redis: instance views and the window budget.

Pure functions (no I/O), so the rules are unit-tested without Kafka or Redis:

- an instance whose heartbeat has expired is left out of the window (DESIGN.md
  "scale-out": a silent instance gets no new work);
- a missing snapshot, or one older than ``stale_after_s``, gives ``state=None`` and
  ``stale=True``: routers then use the LPS average case and flag the decision;
- free slots = the model's ``max_concurrency`` minus the slots held in Redis;
- the resident list holds at least as many running and waiting requests as the engine's
  own ``/metrics`` counts in the heartbeat (``routing.engine_counts``); each resident's
  time at the engine (``now - arrived_at``) goes with it (``InstanceView.waited_ms``), for
  models whose engine reports no prefill progress (``routing.sfs.catch_up``), and so do the
  requests that left the instance recently (``InstanceView.finished``, timed from ``now``);
- a model's Eq. 9 coefficients refitted online by its workers (``routing.recalibration``)
  replace the configured ones while their record is at most ``max_age_s`` old
  (:func:`live_step_models`), and so does the dispatch delay (decision → engine) they
  measured (:func:`live_dispatch_ms`), which is added to every TTFT predicted there;
- the window budget per tenant = min(remaining in the ledger period, pacing allowance),
  where the allowance spends the remaining budget evenly over what is left of the
  period, times ``pacing_factor`` (0 turns pacing off).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from routing.engine_counts import reconcile_engine_counts
from routing.steptime import StepTimeModel
from routing.types import Budget, InstanceState, InstanceView, RecentFinished
from routing.window import UNLIMITED_USD as UNLIMITED_USD  # one definition, re-exported
from schemas import ClusterConfig, InstanceSnapshot, StepTimeCoefficients, TenantBudget


class LiveLike(Protocol):
    """The fields of ``state.InstanceLive`` the router reads."""

    @property
    def snapshot(self) -> InstanceSnapshot | None: ...
    @property
    def slots_used(self) -> int: ...
    @property
    def alive(self) -> bool: ...
    @property
    def age_s(self) -> float: ...
    @property
    def engine_running(self) -> int | None: ...  # the engine's own counts (vLLM /metrics); None: unknown
    @property
    def engine_waiting(self) -> int | None: ...
    @property
    def engine_kv_usage(self) -> float | None: ...  # 0..1
    @property
    def prefix_hashes(self) -> npt.NDArray[np.uint64] | None: ...  # the prefix model, sorted


def instance_views(
    cluster: ClusterConfig,
    live: Mapping[str, LiveLike],
    now: float,
    stale_after_s: float,
    arrival_rate_per_s: Mapping[str, float] | None = None,
    step_time: Mapping[str, StepTimeModel] | None = None,
    dispatch_ms: Mapping[str, float] | None = None,
) -> tuple[list[InstanceView], list[str]]:
    """Views for the instances that are alive, and the ids left out (no heartbeat).
    ``step_time``: per model, coefficients that replace the configured ones (online refit);
    ``dispatch_ms``: per model, the measured decision-to-engine delay (else 0)."""
    views: list[InstanceView] = []
    excluded: list[str] = []
    rates = arrival_rate_per_s or {}
    steps = step_time or {}
    dispatch = dispatch_ms or {}
    for spec in cluster.instances:
        info = live.get(spec.id)
        if info is None or not info.alive:
            excluded.append(spec.id)
            continue
        model = cluster.model(spec.model)
        snap: InstanceSnapshot | None = info.snapshot
        age_s = float(info.age_s) if snap is not None else math.inf
        stale = snap is None or age_s > stale_after_s or not snap.healthy
        state = None if stale or snap is None else InstanceState.from_snapshot(snap)
        waited: npt.NDArray[np.float64] | None = None
        if state is not None:  # at least as many running/waiting as the engine itself reports
            state = reconcile_engine_counts(
                state,
                info.engine_running,
                info.engine_waiting,
                default_output_tokens=int(model.mean_output_tokens or 128),
                engine_kv_usage=info.engine_kv_usage,
                kv_capacity_tokens=model.scheduler.kv_blocks * model.scheduler.block_size_tokens,
                max_model_len=model.max_model_len,
            )
            assert snap is not None
            waited = np.zeros(state.n)  # rows the engine counts added: just arrived
            waited[: len(snap.residents)] = [
                max(0.0, (now - r.arrived_at) * 1000.0) if r.arrived_at > 0 else 0.0
                for r in snap.residents
            ]
        finished = (
            _recent_finished(snap, now)
            if snap is not None and state is not None and model.prefill_progress == "inferred"
            else None
        )
        views.append(
            InstanceView(
                instance_id=spec.id,
                model=spec.model,
                state=state,
                free_slots=max(0, model.max_concurrency - int(info.slots_used)),
                age_s=age_s if math.isfinite(age_s) else 1e9,
                arrival_rate_per_s=float(rates.get(spec.id, 0.0)),
                stale=stale,
                step_time=steps.get(spec.model),
                dispatch_ms=float(dispatch.get(spec.model, 0.0)),
                prefix_hashes=info.prefix_hashes,
                waited_ms=waited,
                finished=finished,
            )
        )
    return views, excluded


def _recent_finished(snap: InstanceSnapshot, now: float) -> RecentFinished | None:
    """The snapshot's recently finished requests timed from ``now`` (ms ago); None if none."""
    if not snap.finished:
        return None
    a = np.array(
        [(f.prompt_tokens, f.output_tokens, f.arrived_at, f.finished_at) for f in snap.finished],
        dtype=np.float64,
    )
    left_ms = np.maximum(0.0, (now - a[:, 3]) * 1000.0)
    arrived_ms = np.maximum(left_ms, (now - a[:, 2]) * 1000.0)
    return RecentFinished.of(
        np.column_stack([a[:, 0], np.maximum(a[:, 1], 1), arrived_ms, left_ms])
    )


class LiveStepTimeLike(Protocol):
    """The fields of ``state.LiveStepTime`` the router reads."""

    @property
    def coefficients(self) -> StepTimeCoefficients: ...
    @property
    def at(self) -> float: ...
    @property
    def dispatch_ms(self) -> float | None: ...


def live_step_models(
    records: Mapping[str, LiveStepTimeLike], now: float, max_age_s: float
) -> dict[str, StepTimeModel]:
    """Per model, the online-refitted coefficients written at most ``max_age_s`` ago."""
    return {
        model: StepTimeModel.from_coefficients(rec.coefficients)
        for model, rec in records.items()
        if now - rec.at <= max_age_s
    }


def live_dispatch_ms(
    records: Mapping[str, LiveStepTimeLike], now: float, max_age_s: float
) -> dict[str, float]:
    """Per model, the dispatch delay its workers measured, from records at most
    ``max_age_s`` old that carry one."""
    return {
        model: float(rec.dispatch_ms)
        for model, rec in records.items()
        if rec.dispatch_ms is not None and now - rec.at <= max_age_s
    }


@dataclass(frozen=True)
class TenantWindow:
    """One tenant's ledger position for this window."""

    tenant: str
    period_id: str
    limit_usd: float
    remaining_usd: float
    allowance_usd: float


def pacing_allowance(
    remaining_usd: float,
    elapsed_s: float,
    period_left_s: float,
    pacing_factor: float,
) -> float:
    """Money this window may spend: the even share of what is left, times the factor."""
    if pacing_factor <= 0 or remaining_usd <= 0:
        return max(0.0, remaining_usd)
    share = pacing_factor * max(elapsed_s, 1e-3) / max(period_left_s, 1e-3)
    return remaining_usd * min(1.0, share)


def period_left_s(now: float, period_s: float) -> float:
    """Seconds left in the ledger period containing ``now`` (periods aligned to the epoch)."""
    return period_s - (now % period_s)


def window_budget(
    tenants: Iterable[str],
    budgets: Mapping[str, TenantBudget],
    spent_usd: Mapping[str, float],
    period_ids: Mapping[str, str],
    now: float,
    elapsed_s: float,
    pacing_factor: float,
) -> tuple[Budget, dict[str, TenantWindow]]:
    """The ``Budget`` handed to the router and each tenant's ledger position.

    ``spent_usd`` is what the ledger holds for the tenant's current period (reserved plus
    settled). Tenants without a configured budget are unlimited.
    """
    windows: dict[str, TenantWindow] = {}
    remaining: dict[str, float] = {}
    for tenant in dict.fromkeys(tenants):
        spec = budgets.get(tenant)
        if spec is None:
            remaining[tenant] = UNLIMITED_USD
            continue
        left = max(0.0, spec.budget_usd - float(spent_usd.get(tenant, 0.0)))
        allowance = pacing_allowance(
            left, elapsed_s, period_left_s(now, spec.period_s), pacing_factor
        )
        windows[tenant] = TenantWindow(tenant, period_ids[tenant], spec.budget_usd, left, allowance)
        remaining[tenant] = min(left, allowance)
    total = sum(remaining.values()) if remaining else 0.0
    return Budget(window_usd=min(total, UNLIMITED_USD), tenant_remaining_usd=remaining), windows
