"""The window rules around ``Router.decide``, written once for the service and the simulator.

DESIGN.md "one decision core, two worlds": ``streams.service`` (Kafka, Redis, wall clock)
and ``sim.evaluator`` (virtual time) both call these functions, so the simulator makes the
service's hold and give-up decisions by construction. Pure: no I/O and no clock reads; the
time of the window is an input (``now_s``), and so is each query's first-seen time.

The rules, in the order a window applies them:

1. **Admission** (``admit``): with no live instance, or no free slot on any, nothing can be
   placed, so the router is not asked at all; every candidate is held (``NO_LIVE_INSTANCE``
   or ``CAPACITY``) or, past its hold limit, given up.
2. **The batch cut**: the router is asked about at most ``max_batch`` candidates, the
   oldest first; the rest wait for the next window (``OVERFLOW``: not announced, since
   they were never decided).
3. **Hold or give up** (``settle``): a query the router did not place is held for the next
   window until its hold limit, then given up with a final decision; a ``REJECTED`` one
   (e.g. longer than every model's context) is final at once. The limit comes from the
   reason, never from the reason's text: ``budget_hold_s`` for a budget deferral (the
   router flags it ``BUDGET_DEFERRED``; the service also when a budget reservation is lost
   to another router), ``max_hold_s`` for everything else. While the service routes blind
   (Redis away) a short budget is the blind allowance's, so it waits ``max_hold_s`` too.

Before all three, **load shedding** (``shed``) bounds the router's own lag in a flood: a
query that has waited ``shed_after_slo`` times its TTFT SLO since it was sent (so, with a
factor of 1 or more, one whose SLO can no longer be met) is given up at once, and past
``shed_backlog`` queries waiting in the router (held + not yet decided) the excess is given
up too, the earliest deadline (sent + SLO) first: the queries most likely to miss theirs.
Each gets a final decision with the reason ``SHED`` (status ``REJECTED``), never silence,
and costs no prediction and no reservation, so a router behind sheds its way back to the
head of its input instead of routing every query late. Both knobs are off (0) by default.

Budget pacing itself (how much a window may spend) is ``streams.views.window_budget`` in
the service and the ``EvalConfig`` allowance in the simulator; both hand the router a
``Budget`` bounded by ``UNLIMITED_USD``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from routing.window_defaults import BUDGET_HOLD_S as BUDGET_HOLD_S
from routing.window_defaults import MAX_BATCH as MAX_BATCH
from routing.window_defaults import MAX_HOLD_S as MAX_HOLD_S
from routing.window_defaults import SHED_AFTER_SLO as SHED_AFTER_SLO
from routing.window_defaults import SHED_BACKLOG as SHED_BACKLOG
from routing.window_defaults import UNLIMITED_USD as UNLIMITED_USD
from schemas import Decision, DecisionFlag, DecisionStatus

T = TypeVar("T")

_PLACED = (DecisionStatus.ROUTED, DecisionStatus.OVER_BUDGET)


class HoldReason(StrEnum):
    """Why a query was not placed in a window (held, or given up once it waited too long)."""

    NO_LIVE_INSTANCE = "no_live_instance"  # no instance heart-beats: the router is not asked
    CAPACITY = "capacity"  # every live instance is full: the router is not asked
    OVERFLOW = "overflow"  # past max_batch: asked in a later window
    BUDGET = "budget"  # the window or tenant budget could not pay for it
    SLOT_LOST = "slot_lost"  # its slot reservation was lost to another router
    BLIND_SHORT = "blind_short"  # Redis away: the blind allowance (budget or slots) is short
    DEFERRED = "deferred"  # the router deferred it for another reason (its reason says)
    REJECTED = "rejected"  # the router rejected it: final at once
    SHED = "shed"  # load shedding (``shed``): waited past its SLO, or the backlog is too long


@dataclass(frozen=True)
class WindowSettings:
    """The window rules' knobs, with the one set of defaults both worlds use."""

    max_batch: int = MAX_BATCH  # most queries the router is asked about per window
    max_hold_s: float = MAX_HOLD_S  # hold limit for capacity, no live instance, deferrals
    budget_hold_s: float = BUDGET_HOLD_S  # hold limit for budget deferrals
    shed_backlog: int = SHED_BACKLOG  # most queries waiting in the router; 0: no limit
    shed_after_slo: float = SHED_AFTER_SLO  # shed after waiting this × TTFT SLO; 0: never

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"WindowSettings.max_batch must be >= 1, got {self.max_batch}")
        if self.shed_backlog < 0:
            raise ValueError(
                f"WindowSettings.shed_backlog must be >= 0 (0: off), got {self.shed_backlog}"
            )
        for name in ("max_hold_s", "budget_hold_s", "shed_after_slo"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"WindowSettings.{name} must be >= 0, got {v}")

    @classmethod
    def of(cls, config: object) -> WindowSettings:
        """The settings from a config object that has a field of each name (the service's
        ``RouterConfig``, the simulator's ``EvalConfig``): no knob is restated twice."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def hold_limit_s(self, reason: HoldReason, blind: bool = False) -> float:
        """How long a query held for ``reason`` may wait before it is given up."""
        if reason == HoldReason.BUDGET and not blind:
            return self.budget_hold_s
        return self.max_hold_s


@dataclass(frozen=True)
class Held(Generic[T]):
    """A query that waits for a later window. ``decision`` is the router's, if it was asked."""

    item: T
    reason: HoldReason
    text: str
    decision: Decision | None = None


@dataclass(frozen=True)
class GivenUp(Generic[T]):
    """A query that gets a final, unrouted decision now (``status``: DEFERRED or REJECTED)."""

    item: T
    reason: HoldReason
    status: DecisionStatus
    text: str  # the final reason, "gave up after N s: …" for a hold that timed out
    decision: Decision | None = None


@dataclass
class Admission(Generic[T]):
    """Admission and the batch cut: who is asked, who waits, who is given up already."""

    asked: list[T] = field(default_factory=list)
    held: list[Held[T]] = field(default_factory=list)
    given_up: list[GivenUp[T]] = field(default_factory=list)


@dataclass
class Shedding(Generic[T]):
    """Load shedding: who stays a candidate (in candidate order), who is shed now."""

    kept: list[T] = field(default_factory=list)
    shed: list[GivenUp[T]] = field(default_factory=list)


@dataclass
class WindowPlan(Generic[T]):
    """What a window does with each asked query once the router (and reservations) spoke."""

    routed: list[tuple[T, Decision]] = field(default_factory=list)
    held: list[Held[T]] = field(default_factory=list)
    given_up: list[GivenUp[T]] = field(default_factory=list)


@dataclass(frozen=True)
class Lost:
    """A placed query whose reservation failed (service only): why, and its kind."""

    reason: HoldReason  # BUDGET, SLOT_LOST or BLIND_SHORT
    text: str


def hold_or_give_up(
    item: T,
    first_seen_s: float,
    reason: HoldReason,
    text: str,
    now_s: float,
    settings: WindowSettings,
    decision: Decision | None = None,
    blind: bool = False,
) -> Held[T] | GivenUp[T]:
    """Hold ``item`` for the next window, or give it up once it has waited its limit."""
    if reason == HoldReason.REJECTED:
        return GivenUp(item, reason, DecisionStatus.REJECTED, text, decision)
    limit_s = settings.hold_limit_s(reason, blind)
    if now_s - first_seen_s < limit_s:
        return Held(item, reason, text, decision)
    why = f"gave up after {limit_s:g} s: {text}"
    return GivenUp(item, reason, DecisionStatus.DEFERRED, why, decision)


def shed(
    candidates: Sequence[T],
    sent_s: Sequence[float] | npt.NDArray[np.float64],
    ttft_slo_s: Sequence[float] | npt.NDArray[np.float64],
    now_s: float,
    settings: WindowSettings = WindowSettings(),
) -> Shedding[T]:
    """Load shedding (before admission). ``candidates`` oldest first; ``sent_s`` when each
    was sent (its wait counts from there), ``ttft_slo_s`` its TTFT SLO in seconds.

    1. A candidate that has waited ``shed_after_slo`` × its SLO or longer is shed.
    2. Past ``shed_backlog`` candidates left, the excess is shed, earliest deadline
       (``sent_s + ttft_slo_s``) first; ties: the older candidate first.

    Both off (0): everyone is kept, at no cost."""
    out: Shedding[T] = Shedding()
    n = len(candidates)
    factor, backlog = settings.shed_after_slo, settings.shed_backlog
    if n == 0 or (factor <= 0 and (backlog <= 0 or n <= backlog)):
        out.kept = list(candidates)
        return out
    sent = np.asarray(sent_s, dtype=np.float64)
    slo = np.asarray(ttft_slo_s, dtype=np.float64)
    if sent.shape != (n,) or slo.shape != (n,):
        raise ValueError(f"shed: {n} candidates but {sent.size} send times and {slo.size} SLOs")
    waited = now_s - sent
    late = waited >= factor * slo if factor > 0 else np.zeros(n, dtype=np.bool_)
    why = {
        int(k): f"shed: waited {waited[k]:.3g} s, past {factor:g} x its TTFT SLO of {slo[k]:.3g} s"
        for k in np.flatnonzero(late)
    }
    left = np.flatnonzero(~late)
    if backlog > 0 and left.size > backlog:
        order = left[np.argsort((sent + slo)[left], kind="stable")]
        text = (
            f"shed: {left.size} queries waiting in the router, past its backlog limit of "
            f"{backlog} (earliest deadline first)"
        )
        why.update({int(k): text for k in order[: left.size - backlog]})
    if not why:
        out.kept = list(candidates)
        return out
    for k, item in enumerate(candidates):
        reason = why.get(k)
        if reason is None:
            out.kept.append(item)
        else:
            out.shed.append(GivenUp(item, HoldReason.SHED, DecisionStatus.REJECTED, reason))
    return out


def admit(
    candidates: Sequence[T],
    first_seen_s: Sequence[float],
    free_slots: Sequence[int],
    now_s: float,
    settings: WindowSettings = WindowSettings(),
    excluded: Sequence[str] = (),
) -> Admission[T]:
    """Admission and the batch cut (rules 1 and 2). ``candidates`` oldest first;
    ``free_slots`` one entry per live instance; ``excluded``: instances left out (no
    heartbeat), named in the reason when none is live."""
    out: Admission[T] = Admission()
    if not free_slots or sum(free_slots) == 0:
        if not free_slots:
            reason = HoldReason.NO_LIVE_INSTANCE
            text = f"no live instance (no heartbeat from {', '.join(excluded) or 'any instance'})"
        else:
            reason, text = HoldReason.CAPACITY, "every live instance is at its capacity"
        for item, seen in zip(candidates, first_seen_s, strict=True):
            verdict = hold_or_give_up(item, seen, reason, text, now_s, settings)
            if isinstance(verdict, Held):
                out.held.append(verdict)
            else:
                out.given_up.append(verdict)
        return out
    out.asked = list(candidates[: settings.max_batch])
    out.held = [
        Held(item, HoldReason.OVERFLOW, "past max_batch: asked in the next window")
        for item in candidates[settings.max_batch :]
    ]
    return out


def not_placed_reason(decision: Decision) -> HoldReason:
    """The reason of a decision that placed nothing, from its status and flags (not its text)."""
    if decision.status == DecisionStatus.REJECTED:
        return HoldReason.REJECTED
    if DecisionFlag.BUDGET_DEFERRED in decision.flags:
        return HoldReason.BUDGET
    return HoldReason.DEFERRED


def settle(
    asked: Sequence[T],
    first_seen_s: Sequence[float],
    decisions: Sequence[Decision],
    now_s: float,
    settings: WindowSettings = WindowSettings(),
    lost: Mapping[int, Lost] | None = None,
    blind: bool = False,
) -> WindowPlan[T]:
    """Hold or give up (rule 3): each asked query routed, held or given up.

    ``decisions`` are the router's, in the order of ``asked``; ``lost`` maps positions in
    ``asked`` whose reservation failed after the router placed them (they are held like a
    deferral of that kind).
    """
    plan: WindowPlan[T] = WindowPlan()
    lost = lost or {}
    for k, (item, seen, d) in enumerate(zip(asked, first_seen_s, decisions, strict=True)):
        miss = lost.get(k)
        if miss is None and d.status in _PLACED and d.instance_id:
            plan.routed.append((item, d))
            continue
        if miss is not None:
            reason, text = miss.reason, miss.text
        else:
            reason = not_placed_reason(d)
            text = d.reason or f"router decided {d.status.value}"
        verdict = hold_or_give_up(item, seen, reason, text, now_s, settings, d, blind)
        if isinstance(verdict, Held):
            plan.held.append(verdict)
        else:
            plan.given_up.append(verdict)
    return plan


def carried(admission: Admission[T], plan: WindowPlan[T]) -> list[T]:
    """The queries that wait for the next window, in candidate order (oldest first): the
    asked ones held after the router spoke, then the batch cut's overflow (or, when nobody
    was asked, everyone admission held)."""
    return [h.item for h in plan.held] + [h.item for h in admission.held]
