"""The records the state rooms hand out (``state.protocols``): what a router, worker or
rescuer reads back from Redis, independent of how it is stored."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from schemas import InstanceSnapshot, StepTimeCoefficients

Verdict = Literal["new", "duplicate", "conflict"]
ClaimOutcome = Literal["won", "lost", "wait", "busy"]
LeaseOutcome = Literal["marked", "held", "ours", "lost"]


@dataclass(frozen=True)
class InstanceLive:
    """One instance as the router sees it.

    ``snapshot`` is None when there is no live heartbeat (never started, or its TTL ran
    out): the router then uses LPS estimates. ``age_s`` is ``now - taken_at`` (``inf``
    without a snapshot); ``slots_used`` counts capacity slots held by routed, unfinished
    queries (queued in Kafka or running).
    """

    instance_id: str
    snapshot: InstanceSnapshot | None
    slots_used: int
    alive: bool
    age_s: float
    max_concurrency: int | None = None
    engine_running: int | None = None  # as the engine itself reports (vLLM /metrics)
    engine_waiting: int | None = None
    engine_kv_usage: float | None = None  # KV-cache usage, 0..1
    # block hashes the router's model of its prefix cache holds (state.prefix), sorted;
    # None: no model kept for it (nothing routed there with prefix hashes yet, or expired)
    prefix_hashes: npt.NDArray[np.uint64] | None = None

    def free_slots(self, max_slots: int) -> int:
        return max(0, max_slots - self.slots_used)


@dataclass(frozen=True)
class LiveStepTime:
    """One model's Eq. 9 coefficients as its workers refit them online
    (``routing.recalibration``): the last write wins; ``version`` counts the writes."""

    model: str
    coefficients: StepTimeCoefficients
    version: int
    at: float  # unix seconds of the write
    rows: int  # observations in the writer's window
    instance_id: str  # the worker that wrote it
    fit_mape: float | None = None  # the fit's error on its rows (a fraction)
    ttft_error: float | None = None  # the writer's recent |predicted - measured| / measured
    dispatch_ms: float | None = None  # the writer's median decision-to-engine delay

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.at)


@dataclass(frozen=True)
class BudgetStatus:
    """One tenant's ledger for one period. ``limit_usd`` is None until a reservation set it."""

    tenant: str
    period_id: str
    limit_usd: float | None
    reserved_usd: float
    spent_usd: float
    n_reserved: int = 0
    n_settled: int = 0

    @property
    def committed_usd(self) -> float:
        return self.reserved_usd + self.spent_usd

    def remaining_usd(self, limit_usd: float | None = None) -> float:
        """``limit - reserved - spent`` (never negative), for ``limit_usd`` or the stored limit."""
        limit = self.limit_usd if limit_usd is None else limit_usd
        if limit is None:
            raise ValueError(
                f"tenant {self.tenant!r} period {self.period_id!r} has no stored limit; pass limit_usd"
            )
        return max(0.0, limit - self.committed_usd)


@dataclass(frozen=True)
class ResultMark:
    """A result was published; ``cost_usd`` as the worker settled it (None if not recorded)."""

    cost_usd: float | None


@dataclass(frozen=True)
class Starts:
    """One start of a query by a worker: ``number`` counts every start (1 the first time);
    ``processes`` the distinct worker processes that have started it, this one included."""

    number: int
    processes: int


@dataclass(frozen=True)
class DedupeEntry:
    body_sha256: str
    routed_to: str | None
    intent: RouteIntent | None = None


@dataclass(frozen=True)
class RouteIntent:
    """Where a router was sending a query, and the exact decision, before Kafka acknowledged it."""

    instance_id: str
    decision_json: str
    # set by a router re-routing a rescued copy (``streams.rescue``): the silent instance the
    # query was routed to. Not stored: ``mark_intent_many`` lets such an intent replace the
    # original routing, which would otherwise count as "taken" and drop the re-routed copy.
    rerouted_from: str | None = None


@dataclass(frozen=True)
class PrefixTouch:
    """Blocks of one query on one instance, and that instance's model capacity
    (``state.prefix``). ``capacity_tokens`` is the configured one (the instance's KV cache),
    used until a worker stores a reconciled one: a touch with ``set_capacity`` stores its
    ``capacity_tokens`` in the model, and every later touch evicts down to that."""

    instance_id: str
    hashes: Sequence[int]
    block_tokens: float
    capacity_tokens: float
    set_capacity: bool = False
