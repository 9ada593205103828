"""``StateStore`` is split by concern behind Protocols (``state.protocols``): every public
method belongs to exactly one concern, and each concern's implementation has the
signatures its Protocol promises (so callers typed against a Protocol get a StateStore)."""

from __future__ import annotations

import inspect

from state import protocols
from state.claims import RedisClaims
from state.dedupe import RedisDedupe
from state.ledger import RedisLedger
from state.liveness import RedisLiveness
from state.prefix import RedisPrefix
from state.results import RedisResults
from state.store import StateStore

CONCERNS: dict[type, type] = {
    protocols.LivenessWriter: RedisLiveness,
    protocols.LivenessReader: RedisLiveness,
    protocols.StepTimePublisher: RedisLiveness,
    protocols.Dedupe: RedisDedupe,
    protocols.Ledger: RedisLedger,
    protocols.LedgerRebuild: RedisLedger,
    protocols.Slots: RedisClaims,
    protocols.Claims: RedisClaims,
    protocols.Results: RedisResults,
    protocols.PrefixModel: RedisPrefix,
}
LIFECYCLE = {"connect", "close", "ping"}


def own_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if inspect.iscoroutinefunction(v)}


def test_every_public_method_has_exactly_one_concern() -> None:
    public = {
        n
        for n, f in inspect.getmembers(StateStore, inspect.iscoroutinefunction)
        if not n.startswith("_") and n not in LIFECYCLE
    }
    owners: dict[str, list[str]] = {}
    for proto in CONCERNS:
        for n in own_methods(proto):
            owners.setdefault(n, []).append(proto.__name__)
    assert public - owners.keys() == set(), "a StateStore method no Protocol names"
    assert owners.keys() - public == set(), "a Protocol method StateStore lacks"
    assert {n: o for n, o in owners.items() if len(o) > 1} == {}


def test_each_concern_module_implements_its_protocol_with_the_same_signatures() -> None:
    for proto, impl in CONCERNS.items():
        for n in own_methods(proto):
            assert n in vars(impl), f"{impl.__name__} does not define {proto.__name__}.{n}"
            want = inspect.signature(getattr(proto, n))
            got = inspect.signature(getattr(impl, n))
            assert list(want.parameters) == list(got.parameters), (proto.__name__, n)
            assert want.return_annotation == got.return_annotation, (proto.__name__, n)
            for p_want, p_got in zip(
                want.parameters.values(), got.parameters.values(), strict=True
            ):
                assert p_want.kind == p_got.kind, (proto.__name__, n, p_want.name)
                assert p_want.annotation == p_got.annotation, (proto.__name__, n, p_want.name)
                # a Protocol writes a default as `...`; it must have one where the code has one
                assert (p_want.default is inspect.Parameter.empty) == (
                    p_got.default is inspect.Parameter.empty
                ), (proto.__name__, n, p_want.name)


def test_the_components_unions_cover_what_they_call() -> None:
    router = set().union(*(own_methods(p) for p in protocols.RouterState.__mro__[1:-1]))
    worker = set().union(*(own_methods(p) for p in protocols.WorkerState.__mro__[1:-1]))
    # the router never writes a worker's liveness nor claims a copy; the worker never dedupes
    assert "heartbeat" not in router and "claim_run" not in router
    assert "dedupe_many" not in worker and "reserve_slots" not in worker
    assert {"snapshots_and_step_times", "dedupe_many", "reserve_budget", "reserve_slots"} <= router
    assert {"heartbeat", "finish", "claim_run", "settle", "step_time_publish"} <= worker
