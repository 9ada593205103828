"""Bodies of the ``route.<instance>``, ``decisions``, ``results`` and ``dead-letters`` topics."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Collection
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from schemas.query import Query, QueryId


class DecisionStatus(StrEnum):
    ROUTED = "routed"
    DEFERRED = "deferred"  # did not fit in the budget; not sent to any instance
    OVER_BUDGET = "over_budget"  # routed although it breaks the budget (configuration allows it)
    REJECTED = "rejected"  # duplicate or no instance at all


class DecisionFlag(StrEnum):
    SLO_INFEASIBLE = "slo_infeasible"  # no instance could meet the SLO: sent to the lowest-TTFT one
    LPS_ESTIMATE = "lps_estimate"  # TTFT from the LPS average case (no live state)
    STALE_STATE = "stale_state"  # snapshot older than the staleness limit
    BUDGET_BLIND = "budget_blind"  # ledger unreachable: spend reserved conservatively
    DEADLINE = "deadline"  # solver stopped at its deadline; best feasible decision returned
    REROUTED = "rerouted"  # re-routed after its instance stopped heart-beating
    MODEL_CONSTRAINED = "model_constrained"  # the query's ``model`` limited the instances
    # deferred because the window or tenant budget could not pay for it (held for
    # ``budget_hold_s``, not ``max_hold_s``: routing.window)
    BUDGET_DEFERRED = "budget_deferred"


class WindowStats(BaseModel):
    """Solver figures of the whole window a decision belongs to."""

    model_config = ConfigDict(extra="forbid")

    window_id: str
    n_queries: int = Field(ge=0)
    solver: str
    objective: float
    lp_bound: float
    gap: float = Field(ge=0)
    budget_dual: float = 0.0
    budget_usd: float
    spend_usd: float
    decide_ms: float = Field(ge=0)
    ttft_rounds: int = Field(default=0, ge=0)


class Decision(BaseModel):
    """Where one query goes and why (``decisions`` audit topic)."""

    model_config = ConfigDict(extra="forbid")

    query_id: QueryId
    tenant: str
    status: DecisionStatus
    instance_id: str | None = None
    model: str | None = None
    policy: str
    flags: list[DecisionFlag] = Field(default_factory=list)
    predicted_quality: float | None = None
    predicted_quality_lb: float | None = None
    predicted_cost_usd: float | None = Field(default=None, ge=0)
    predicted_ttft_ms: float | None = Field(default=None, ge=0)
    predicted_output_tokens: int | None = Field(default=None, ge=0)
    # prompt tokens the router's prefix-cache model of the chosen instance held for this
    # query when it was routed (state.prefix; earlier queries of its window sent there
    # included); None when unknown (a cloud model, no model read). The worker compares
    # them with the engine's own hit count (workers.prefix_reconcile).
    predicted_cached_tokens: int | None = Field(default=None, ge=0)
    decided_at: float = Field(ge=0)
    budget_period: str | None = None  # ledger period the predicted cost was reserved in
    reason: str | None = None
    window: WindowStats | None = None


class RoutedQuery(BaseModel):
    """Body of ``route.<instance>``: the query and the decision that sent it there.

    The router writes it with ``routed_query_bytes`` (the query's own bytes as it received
    them, spliced in: no re-encoding per query); ``routed_query_raw`` gets them back.
    """

    model_config = ConfigDict(extra="forbid")

    query: Query
    decision: Decision


_ROUTED_HEAD, _ROUTED_SEP = b'{"query":', b',"decision":'
_WINDOW_FIELD = b',"window":'
_DECISION_JSON = Decision.__pydantic_serializer__.to_json
_DECISION_FIELDS = frozenset(Decision.model_fields)
_new_object, _set = object.__new__, object.__setattr__
_NO_WINDOW = {"window"}  # a set: pydantic-core takes a frozenset slowly (converted per call)


def decision_with(d: Decision, update: dict[str, Any]) -> Decision:
    """``d.model_copy(update=update)`` (fields of ``Decision`` only, not validated, as
    there), at half its cost: the router copies each routed query's decision once."""
    if not _DECISION_FIELDS.issuperset(update):
        raise ValueError(f"not fields of Decision: {sorted(update.keys() - _DECISION_FIELDS)}")
    copied = _new_object(Decision)
    _set(copied, "__dict__", {**d.__dict__, **update})
    _set(copied, "__pydantic_fields_set__", d.__pydantic_fields_set__ | update.keys())
    _set(copied, "__pydantic_extra__", None)
    _set(copied, "__pydantic_private__", None)
    return copied


# every field in declaration order (the serialiser writes ``__dict__`` in its order), the
# required ones as placeholders that ``decision_trusted`` requires to be given
_DECISION_TEMPLATE: dict[str, Any] = {
    name: None if f.is_required() or f.default_factory is not None else f.default
    for name, f in Decision.model_fields.items()
}
_DECISION_REQUIRED = frozenset(n for n, f in Decision.model_fields.items() if f.is_required())
# fields whose default is made per object (``flags``: a fresh list each)
_DECISION_FACTORIES = {
    n: f.default_factory for n, f in Decision.model_fields.items() if f.default_factory is not None
}


def decision_trusted(values: dict[str, Any]) -> Decision:
    """``Decision(**values)`` without validation, for values already of the fields' types
    and within their bounds: the decision core builds a window's decisions from its own
    arrays this way (a quarter of the validated construction's cost; the policies' tests
    hold every decision they make to ``Decision.model_validate``). Equal to the validated
    object, with the same fields set and the same JSON."""
    names = _checked_fields(values.keys())
    factories = [(n, f) for n, f in _DECISION_FACTORIES.items() if n not in names]
    return _assemble(values, factories, set(values))


def trusted_decisions(fields: Collection[str]) -> Callable[[dict[str, Any]], Decision]:
    """``decision_trusted`` for value dicts that all have exactly ``fields``, their names
    checked once here rather than per decision: a window builds a thousand decisions of
    two shapes (routed or not). The caller keeps each dict to those fields."""
    names = _checked_fields(fields)
    factories = [(n, f) for n, f in _DECISION_FACTORIES.items() if n not in names]
    fields_set = set(names)

    def make(values: dict[str, Any]) -> Decision:
        return _assemble(values, factories, fields_set.copy())

    return make


def _checked_fields(fields: Collection[str]) -> frozenset[str]:
    names = frozenset(fields)
    if not _DECISION_FIELDS.issuperset(names):
        raise ValueError(f"not fields of Decision: {sorted(names - _DECISION_FIELDS)}")
    if not _DECISION_REQUIRED <= names:
        raise ValueError(f"Decision fields missing: {sorted(_DECISION_REQUIRED - names)}")
    return names


def _assemble(
    values: dict[str, Any], factories: list[tuple[str, Any]], fields_set: set[str]
) -> Decision:
    d = _new_object(Decision)
    full = {**_DECISION_TEMPLATE, **values}
    for name, factory in factories:
        full[name] = factory()
    _set(d, "__dict__", full)
    _set(d, "__pydantic_fields_set__", fields_set)
    _set(d, "__pydantic_extra__", None)
    _set(d, "__pydantic_private__", None)
    return d


def decision_bytes(d: Decision, windows: dict[int, bytes]) -> bytes:
    """``d.model_dump_json(exclude_none=True)``, encoded, with its ``window`` (the last
    field) serialised once per ``WindowStats`` object: ``windows`` (id -> JSON) remembers
    it. Keep one ``windows`` for decisions that stay alive together (one window's, which
    share their stats), so no id is reused by another object while it is kept."""
    if d.window is None:
        return _DECISION_JSON(d, exclude_none=True)
    key = id(d.window)
    window = windows.get(key)
    if window is None:
        window = windows[key] = d.window.model_dump_json(exclude_none=True).encode()
    # pydantic's serializer itself: bytes, as ``model_dump_json`` would encode them
    head = _DECISION_JSON(d, exclude_none=True, exclude=_NO_WINDOW)
    return head[:-1] + _WINDOW_FIELD + window + b"}"


# the fields the router stamps on a routed decision, with the two after them: the last five
# of ``Decision`` in declaration order, which its JSON keeps (held by tests/schemas)
_STAMPED = {"predicted_cached_tokens", "decided_at", "budget_period", "reason", "window"}


def decision_stamped_bytes(
    d: Decision,
    decided_at: float,
    budget_period: str | None,
    cached_tokens: int | None,
    memo: dict[Any, bytes],
) -> bytes:
    """``decision_bytes(decision_with(d, update), memo)`` for the update the router stamps
    on a routed decision (``decided_at``, ``budget_period`` and, when not None,
    ``predicted_cached_tokens``), without copying ``d``: pydantic's JSON of the fields
    before the stamped ones, then the last five written in their order, each value by
    pydantic's own encoder. ``memo`` keeps what a window shares (its ``decided_at`` with a
    period, its ``WindowStats``), as ``decision_bytes``'s ``windows``."""
    head = _DECISION_JSON(d, exclude_none=True, exclude=_STAMPED)
    parts = [head[:-1]]
    cached = d.predicted_cached_tokens if cached_tokens is None else cached_tokens
    if cached is not None:
        parts.append(b',"predicted_cached_tokens":' + to_json(cached))
    key = ("stamp", decided_at, budget_period)
    stamp = memo.get(key)
    if stamp is None:
        stamp = b',"decided_at":' + to_json(decided_at)
        if budget_period is not None:
            stamp += b',"budget_period":' + to_json(budget_period)
        memo[key] = stamp
    parts.append(stamp)
    if d.reason is not None:
        parts.append(b',"reason":' + to_json(d.reason))
    if d.window is not None:
        wkey = id(d.window)
        window = memo.get(wkey)
        if window is None:
            window = memo[wkey] = d.window.model_dump_json(exclude_none=True).encode()
        parts.append(_WINDOW_FIELD + window)
    parts.append(b"}")
    return b"".join(parts)


def routed_query_bytes(raw_query: bytes, decision_json: bytes) -> bytes:
    """A ``RoutedQuery`` body from the query's raw JSON (validated by ``parse_query``) and
    the decision's JSON: ``{"query":<raw>,"decision":<json>}``."""
    return _ROUTED_HEAD + raw_query.strip() + _ROUTED_SEP + decision_json + b"}"


def routed_query_raw(value: bytes, routed: RoutedQuery) -> bytes:
    """The query's own body inside a routed message written by ``routed_query_bytes``, or
    its JSON when the message is shaped otherwise (``routed`` is ``value`` parsed).

    The decision's JSON cannot contain the separator (its strings escape quotes), so the
    last one is the router's own.
    """
    cut = value.rfind(_ROUTED_SEP)
    if value.startswith(_ROUTED_HEAD) and cut > len(_ROUTED_HEAD):
        return value[len(_ROUTED_HEAD) : cut]
    return routed.query.model_dump_json(exclude_none=True).encode()


class ResultCode(StrEnum):
    """Machine-readable kind of an error ``Result`` that no engine ran (``Result.code``)."""

    NOT_ROUTED = "not_routed"  # the router gave up on it: no capacity, no model can hold it, …
    INSUFFICIENT_QUOTA = "insufficient_quota"  # the router gave up: the tenant's budget is spent
    SHED = "shed"  # the router shed it under overload (routing.window.shed): retry later


class Result(BaseModel):
    """Body of ``results``: what a worker got back from its engine (or, with no
    ``instance_id``, the router's final answer for a query it did not route).

    ``code`` says what kind of error ``error`` is when a program must tell: set by the
    router on the error Results it publishes (``ResultCode``); None on a success and on an
    engine's error (older producers never set it).
    """

    model_config = ConfigDict(extra="forbid")

    query_id: QueryId
    tenant: str
    instance_id: str
    model: str
    text: str = ""
    ttft_ms: float | None = Field(default=None, ge=0)
    e2e_ms: float | None = Field(default=None, ge=0)
    prompt_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    # of ``prompt_tokens``, those the engine found in its prefix cache, billed at the
    # model's cached-input price; None: the engine did not say (billed at the input price)
    cached_tokens: int | None = Field(default=None, ge=0)
    cost_usd: float = Field(default=0.0, ge=0)
    slo_met: bool | None = None
    error: str | None = None
    code: ResultCode | None = None
    # the engine's reason for the last token ("stop", "length", "tool_calls"…), when known
    finish_reason: str | None = Field(default=None, max_length=64)
    attempt: int = Field(default=1, ge=1)
    finished_at: float = Field(ge=0)

    @property
    def ok(self) -> bool:
        return self.error is None


class RelayChunk(BaseModel):
    """Body of ``relay.<gateway>``: text a worker relays while the engine streams one query.

    ``seq`` counts the query's chunks from 0 (per attempt); the last one has ``done`` set and
    carries the token counts. Keyed by query id, so one query's chunks stay in order.
    """

    model_config = ConfigDict(extra="forbid")

    query_id: QueryId
    model: str | None = None  # the model serving it
    attempt: int = Field(default=1, ge=1)
    seq: int = Field(ge=0)
    text: str = ""
    done: bool = False
    finish_reason: str | None = Field(default=None, max_length=64)
    prompt_tokens: int | None = Field(default=None, ge=0)
    output_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)  # as ``Result.cached_tokens``
    error: str | None = None


MAX_DEAD_LETTER_RAW_BYTES = 262_144  # base64 grows it by a third; stays far below 1 MB brokers


class DeadLetter(BaseModel):
    """Body of ``dead-letters``: a message that could not be handled, kept whole when small.

    A raw message over ``MAX_DEAD_LETTER_RAW_BYTES`` keeps its first bytes, its size and its
    SHA-256; the whole message stays at ``topic``/``partition``/``offset`` (so a dead letter
    never grows past what the broker accepts, which would stall the stream).
    """

    model_config = ConfigDict(extra="forbid")

    raw_b64: str
    raw_size_bytes: int = Field(default=0, ge=0)
    raw_sha256: str = ""
    truncated: bool = False
    reason: str
    topic: str
    partition: int = Field(ge=-1)
    offset: int = Field(ge=-1)
    stage: str = "validate"
    received_at: float = Field(ge=0)

    @classmethod
    def of(
        cls,
        raw: bytes,
        reason: str,
        topic: str,
        partition: int,
        offset: int,
        received_at: float,
        stage: str = "validate",
        max_raw_bytes: int = MAX_DEAD_LETTER_RAW_BYTES,
    ) -> DeadLetter:
        kept = raw[:max_raw_bytes]
        return cls(
            raw_b64=base64.b64encode(kept).decode("ascii"),
            raw_size_bytes=len(raw),
            raw_sha256=hashlib.sha256(raw).hexdigest(),
            truncated=len(kept) < len(raw),
            reason=reason[:4096],
            topic=topic,
            partition=partition,
            offset=offset,
            stage=stage,
            received_at=received_at,
        )

    def raw(self) -> bytes:
        return base64.b64decode(self.raw_b64)
