"""The state concerns as Protocols: each caller depends on the narrow ones it uses.

``state.store.StateStore`` implements every one over one Redis client (one module per
concern: ``state.liveness``, ``state.dedupe``, ``state.ledger``, ``state.claims``,
``state.results``), so a router's window reads stay one pipelined round trip; a test or
another backend can implement just the Protocols a component needs.

| Protocol | implemented in | used by |
| --- | --- | --- |
| ``LivenessWriter`` | ``state.liveness`` | worker |
| ``LivenessReader`` | ``state.liveness`` | router, rescuer, router's blind mode |
| ``StepTimePublisher`` | ``state.liveness`` | worker (``workers.steptime_feed``) |
| ``Dedupe`` | ``state.dedupe`` | router |
| ``Ledger`` | ``state.ledger`` | router, worker, rescuer, gateway, batch jobs |
| ``LedgerRebuild`` | ``state.ledger`` | router (``streams.ledger_rebuild``) |
| ``Slots`` | ``state.claims`` | router, rescuer |
| ``Claims`` | ``state.claims`` | worker, rescuer |
| ``Results`` | ``state.results`` | worker, rescuer |

``RouterState``, ``WorkerState`` and ``RescuerState`` are the unions each component needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from schemas import FinishedRequest, ResidentRequest, StepTimeCoefficients
from state.records import (
    BudgetStatus,
    ClaimOutcome,
    DedupeEntry,
    InstanceLive,
    LeaseOutcome,
    LiveStepTime,
    PrefixTouch,
    ResultMark,
    RouteIntent,
    Starts,
    Verdict,
)


class LivenessWriter(Protocol):
    """What a worker writes about its instance: heartbeats, residents and their progress."""

    async def heartbeat(
        self,
        instance_id: str,
        model: str,
        ttl_s: float,
        max_concurrency: int,
        *,
        engine_running: int | None = None,
        engine_waiting: int | None = None,
        engine_kv_usage: float | None = None,
        now: float | None = None,
    ) -> None: ...

    async def resident_add(
        self, instance_id: str, r: ResidentRequest, *, now: float | None = None
    ) -> None: ...

    async def resident_progress(
        self,
        instance_id: str,
        query_id: str,
        prefilled_tokens: int,
        decoded_tokens: int,
        *,
        now: float | None = None,
    ) -> None: ...

    async def resident_done(
        self, instance_id: str, query_id: str, *, now: float | None = None
    ) -> None: ...

    async def residents_reconcile(self, instance_id: str, keep_query_ids: Sequence[str]) -> int: ...

    async def residents_sync(
        self,
        instance_id: str,
        residents: Sequence[ResidentRequest],
        *,
        view_at: float | None = None,
    ) -> int: ...

    async def instance_down(self, instance_id: str) -> None: ...

    async def reset_instance(self, instance_id: str) -> None: ...


class LivenessReader(Protocol):
    """What a router (or rescuer) reads about every instance: one round trip per window."""

    async def residents(self, instance_id: str) -> list[ResidentRequest]: ...

    async def snapshots(
        self, instance_ids: Sequence[str], now: float
    ) -> dict[str, InstanceLive]: ...

    async def snapshots_and_step_times(
        self, instance_ids: Sequence[str], models: Sequence[str], now: float
    ) -> tuple[dict[str, InstanceLive], dict[str, LiveStepTime]]: ...


class StepTimePublisher(Protocol):
    """A worker publishing its model's online-refitted step-time coefficients."""

    async def step_time_publish(
        self,
        model: str,
        coefficients: StepTimeCoefficients,
        *,
        rows: int,
        instance_id: str,
        ttl_s: float,
        fit_mape: float | None = None,
        ttft_error: float | None = None,
        dispatch_ms: float | None = None,
        now: float | None = None,
    ) -> int: ...


class Dedupe(Protocol):
    """Dedupe verdicts, route intents and routed marks (a router)."""

    async def dedupe(self, query_id: str, body_sha256: str, ttl_s: float) -> Verdict: ...

    async def dedupe_ex(
        self, query_id: str, body_sha256: str, ttl_s: float
    ) -> tuple[Verdict, str | None]: ...

    async def dedupe_many(
        self, items: Sequence[tuple[str, str]], ttl_s: float
    ) -> list[tuple[Verdict, str | None]]: ...

    async def mark_routed(self, query_id: str, instance_id: str) -> bool: ...

    async def mark_routed_many(self, routed: Mapping[str, str]) -> int: ...

    async def mark_intent_many(self, intents: Mapping[str, RouteIntent]) -> dict[str, str]: ...

    async def intents(self, query_ids: Sequence[str]) -> dict[str, RouteIntent]: ...

    async def dedupe_entry(self, query_id: str) -> DedupeEntry | None: ...

    async def forget(self, query_id: str) -> None: ...


class Ledger(Protocol):
    """The budget ledger: reserve and release (routers), settle (workers), status (anyone)."""

    async def reserve_budget(
        self, tenant: str, period_id: str, limit_usd: float, amounts_usd: Mapping[str, float]
    ) -> dict[str, bool]: ...

    async def release_budget(
        self, tenant: str, period_id: str, query_ids: Sequence[str]
    ) -> None: ...

    async def settle(
        self, tenant: str, period_id: str, query_id: str, actual_cost_usd: float
    ) -> bool: ...

    async def budget_status(self, tenant: str, period_id: str) -> BudgetStatus: ...


class LedgerRebuild(Protocol):
    """The ledger's completeness mark and its rebuild from Kafka (``streams.ledger_rebuild``)."""

    async def ledger_mark(self) -> str | None: ...

    async def ledger_lease(
        self, token: str, lease_s: float, *, renew: bool = False
    ) -> LeaseOutcome: ...

    async def ledger_set_mark(self, token: str, value: str) -> bool: ...

    async def ledger_rebuild(
        self,
        tenant: str,
        period_id: str,
        limit_usd: float,
        settled_usd: Mapping[str, float],
        reserved_usd: Mapping[str, float],
    ) -> tuple[int, int]: ...


class Slots(Protocol):
    """Capacity slots a router holds per routed, unfinished query."""

    async def reserve_slots(
        self,
        instance_id: str,
        max_slots: int,
        query_ids: Sequence[str],
        *,
        lease_s: float | None = None,
    ) -> list[bool]: ...

    async def release_slots(self, instance_id: str, query_ids: Sequence[str]) -> None: ...

    async def slots_held(self, instance_id: str) -> list[str]: ...


class Claims(Protocol):
    """Per-copy claims: a worker's right before running, a rescuer's on stranded copies."""

    async def claim_run(
        self, instance_id: str, query_id: str, *, ttl_s: float = ...
    ) -> ClaimOutcome: ...

    async def claim_rescue(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        lease_s: float,
        ttl_s: float = ...,
    ) -> list[ClaimOutcome]: ...

    async def claim_rerouted(
        self, instance_id: str, query_ids: Sequence[str], rescuer_id: str, *, ttl_s: float = ...
    ) -> list[ClaimOutcome]: ...

    async def claim_returned(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        ttl_s: float = ...,
    ) -> list[ClaimOutcome]: ...

    async def claim_state(self, instance_id: str, query_id: str) -> str | None: ...


class Results(Protocol):
    """Published-result marks and start counts."""

    async def mark_result(
        self, query_id: str, ttl_s: float, *, cost_usd: float | None = None
    ) -> bool: ...

    async def finish(
        self,
        instance_id: str,
        query_id: str,
        *,
        result_ttl_s: float,
        cost_usd: float,
        tenant: str | None = None,
        period_id: str | None = None,
        finished: FinishedRequest | None = None,
    ) -> tuple[bool, bool]: ...

    async def result_mark(self, query_id: str) -> ResultMark | None: ...

    async def mark_start(self, query_id: str, process: str, ttl_s: float) -> Starts: ...

    async def has_results(self, query_ids: Sequence[str]) -> list[bool]: ...

    async def has_result(self, query_id: str) -> bool: ...


class PrefixModel(Protocol):
    """The routers' models of the instances' prefix caches (``state.prefix``); read back in
    ``LivenessReader.snapshots`` (``InstanceLive.prefix_hashes``)."""

    async def prefix_touch_many(self, touches: Sequence[PrefixTouch]) -> list[int]: ...


class RouterState(LivenessReader, Dedupe, Ledger, LedgerRebuild, Slots, PrefixModel, Protocol):
    """What a router's window needs (``streams.service``, ``streams.blind``)."""


class WorkerState(
    LivenessWriter, StepTimePublisher, Ledger, Claims, Results, PrefixModel, Protocol
):
    """What a worker needs (``workers.worker``)."""


class RescuerState(LivenessReader, Ledger, Slots, Claims, Results, Protocol):
    """What a router's rescuer of stranded copies needs (``streams.rescue``)."""
