"""Shared state in Redis: instance live state, heartbeats, capacity slots, budget ledger, dedupe.

The only package that knows the key layout (``state.keys``); every read-modify-write is
an atomic Lua script (``state/lua/``). See ``state.store.StateStore``, which implements
every concern's Protocol (``state.protocols``) over one client; callers type against the
narrow Protocols they use.
"""

from state.cluster import StateConfigError
from state.keys import Keys
from state.liveness import FINISHED_KEEP, FINISHED_KEEP_S
from state.protocols import (
    Claims,
    Dedupe,
    Ledger,
    LedgerRebuild,
    LivenessReader,
    LivenessWriter,
    RescuerState,
    Results,
    RouterState,
    Slots,
    StepTimePublisher,
    WorkerState,
)
from state.store import (
    NANO_PER_USD,
    BudgetStatus,
    ClaimOutcome,
    DedupeEntry,
    InstanceLive,
    LiveStepTime,
    ResultMark,
    RouteIntent,
    Starts,
    StateStore,
    StateUnavailable,
    Verdict,
    period_bounds,
    period_id,
    usd_to_nano,
)

__all__ = [
    "FINISHED_KEEP",
    "FINISHED_KEEP_S",
    "Claims",
    "Dedupe",
    "Ledger",
    "LedgerRebuild",
    "LivenessReader",
    "LivenessWriter",
    "RescuerState",
    "Results",
    "RouterState",
    "Slots",
    "StepTimePublisher",
    "WorkerState",
    "NANO_PER_USD",
    "BudgetStatus",
    "DedupeEntry",
    "InstanceLive",
    "LiveStepTime",
    "Keys",
    "ResultMark",
    "Starts",
    "RouteIntent",
    "StateStore",
    "StateUnavailable",
    "StateConfigError",
    "ClaimOutcome",
    "Verdict",
    "period_bounds",
    "period_id",
    "usd_to_nano",
]
