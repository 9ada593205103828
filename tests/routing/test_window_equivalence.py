"""The service's window path and the simulator's make the same decisions (issue 12, item 2).

One query stream is run through ``sim.evaluator.evaluate``; every window it opens is
recorded (its time, its new arrivals, the instance views and the ``Budget`` it handed the
router). The same windows are then replayed through ``streams.service.RouterService`` (an
in-memory Redis and Kafka, the wall clock set to each window's time, the views and budget of
the simulator's window as its snapshots and ledger). Both worlds must admit the same
candidates in the same order, ask the router the same queries, get the same decisions, and
hold, give up and route exactly the same queries: the window rules are
``routing.window``'s in both, so this holds by construction — this test keeps it so. A
second stream is a flood (issue 12, item 5) with load shedding on: both worlds must shed
the same queries in the same windows, and each shed query is answered (code ``shed``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import routing.window as window_mod
import sim.evaluator as evaluator_mod
import streams.service as service_mod
from routing.policies import RouterContext, make_router
from routing.types import Budget, InstanceView, Router
from schemas import ClusterConfig, Decision, DecisionStatus, Query
from sim.cluster import SimCluster
from sim.evaluator import EvalConfig, evaluate
from sim.traffic import SloSpec, Workload, build_workload
from streams.service import Inbound, Money, Pending, RouterConfig, RouterService, Sight
from wiring import topics

MODELS = ["small", "big"]


@dataclass
class _Estimate:
    mean: np.ndarray
    lower: np.ndarray


class _Quality:
    models = MODELS

    def predict(self, texts: Sequence[str]) -> _Estimate:
        bump = np.array([(len(t) % 5) / 50 for t in texts])[:, None]
        mean = np.array([0.55, 0.8])[None, :] + bump
        return _Estimate(mean, mean - np.array([0.05, 0.1])[None, :])


def _cluster() -> ClusterConfig:
    step = {"c0_ms": 5.0, "c1_ms_per_token": 0.02, "c2_ms_per_ctx_token": 1e-5,
            "c3_ms_per_attn_unit": 1e-7}  # fmt: skip
    models = [
        {"name": "small", "input_usd_per_token": 1e-7, "output_usd_per_token": 2e-7,
         "max_concurrency": 6, "step_time": step,
         "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 6}},
        {"name": "big", "input_usd_per_token": 1e-6, "output_usd_per_token": 2e-6,
         "max_concurrency": 4, "step_time": dict(step, c0_ms=15.0, c1_ms_per_token=0.06),
         "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 4}},
    ]  # fmt: skip
    instances = [{"id": "small-0", "model": "small"}, {"id": "small-1", "model": "small"},
                 {"id": "big-0", "model": "big"}]  # fmt: skip
    return ClusterConfig.model_validate({"models": models, "instances": instances})


def _workload(n: int = 160, seed: int = 3, flood: bool = False) -> Workload:
    """Two bursts far above the 16 slots (capacity holds, the batch cut), then a trickle;
    ``flood``: 300 queries at once instead of the first burst, SLOs from 0.3 to 3 s."""
    rng = np.random.default_rng(seed)
    first = rng.uniform(0, 0.01, 300) if flood else rng.uniform(0, 0.3, 70)
    n = n + 230 if flood else n
    arrivals = np.sort(
        np.concatenate([first, rng.uniform(2.0, 2.2, 60), rng.uniform(3, 8, n - len(first) - 60)])
    )
    n_data = 50
    return build_workload(
        arrivals,
        np.tile(np.array([0.5, 0.8]), (n_data, 1)),
        [f"question {i} " + "x" * (i % 13) for i in range(n_data)],
        ["t"] * n_data,
        MODELS,
        rng.integers(100, 3000, n_data),
        np.full((n_data, 2), np.nan),
        SloSpec.parse("uniform:300,3000" if flood else "fixed:2000"),
        rng,
        default_output_tokens=np.array([200.0, 300.0]),
        name="equivalence",
    )


@dataclass
class _Window:
    now: float
    fresh: list[str] = field(default_factory=list)
    views: list[InstanceView] = field(default_factory=list)
    budget: Budget | None = None


@dataclass
class _Trace:
    """What one world's window rules did, window by window, as query ids."""

    shed: list[tuple[float, list[str], list[str]]] = field(default_factory=list)  # seen, shed
    admitted: list[tuple[float, list[str]]] = field(default_factory=list)
    asked: list[list[tuple[str, str, str | None]]] = field(default_factory=list)
    settled: list[tuple[list[str], list[tuple[str, str]], list[tuple[str, str, str]]]] = field(
        default_factory=list
    )


class _Recording:
    """Wraps a router: records each window's questions and answers (and its budget)."""

    def __init__(self, inner: Router, trace: _Trace, on_decide: Callable[..., None] | None = None):
        self.inner, self.trace, self.on_decide = inner, trace, on_decide
        self.name = inner.name

    def decide(
        self, queries: Sequence[Query], instances: Sequence[InstanceView], budget: Budget, now: float
    ) -> list[Decision]:
        if self.on_decide is not None:
            self.on_decide(budget)
        ds = self.inner.decide(queries, instances, budget, now)
        self.trace.asked.append([(d.query_id, d.status.value, d.instance_id) for d in ds])
        return ds


def _qid(item: Any, workload: Workload) -> str:
    return item.query.id if isinstance(item, Pending) else workload.query_id(int(item))


def _record_rules(monkeypatch: pytest.MonkeyPatch, module: Any, trace: _Trace, w: Workload,
                  windows: list[_Window] | None = None) -> None:  # fmt: skip
    """Record ``shed``, ``admit`` and ``settle`` as ``module`` calls them (the one engine)."""
    seen: set[str] = set()

    def shed(candidates: Sequence[Any], sent_s: Sequence[float], slo_s: Sequence[float],
             now_s: float, *a: Any, **kw: Any) -> Any:  # fmt: skip
        ids = [_qid(c, w) for c in candidates]
        out = window_mod.shed(candidates, sent_s, slo_s, now_s, *a, **kw)
        trace.shed.append((now_s, ids, [_qid(g.item, w) for g in out.shed]))
        if windows is not None:
            windows.append(_Window(now_s, [q for q in ids if q not in seen]))
            seen.update(ids)
        return out

    def admit(candidates: Sequence[Any], first_seen_s: Sequence[float], free: Sequence[int],
              now_s: float, *a: Any, **kw: Any) -> Any:  # fmt: skip
        trace.admitted.append((now_s, [_qid(c, w) for c in candidates]))
        return window_mod.admit(candidates, first_seen_s, free, now_s, *a, **kw)

    def settle(*a: Any, **kw: Any) -> Any:
        plan = window_mod.settle(*a, **kw)
        if not a[0]:
            return plan  # nobody was asked (admission held them all): the simulator skips it
        trace.settled.append(
            (
                [_qid(item, w) for item, _ in plan.routed],
                [(_qid(h.item, w), h.reason.value) for h in plan.held],
                [(_qid(g.item, w), g.reason.value, g.status.value) for g in plan.given_up],
            )
        )
        return plan

    monkeypatch.setattr(module, "shed", shed)
    monkeypatch.setattr(module, "admit", admit)
    monkeypatch.setattr(module, "settle", settle)


class _Memory:
    """The Redis calls of a window that reads nothing (the replay supplies views and money)."""

    async def dedupe_many(self, items: Sequence[tuple[str, str]], ttl_s: float) -> list[Any]:
        return [("new", None) for _ in items]

    async def reserve_slots(self, instance_id: str, max_slots: int, qids: Sequence[str],
                            lease_s: float | None = None) -> list[bool]:  # fmt: skip
        return [True] * len(qids)  # the simulator reserves nothing: the views' slots bind

    async def mark_intent_many(self, intents: Any) -> dict[str, str]:
        return {}

    async def prefix_touch_many(self, touches: Any) -> list[int]:
        return [0] * len(touches)

    async def mark_routed_many(self, marks: Any) -> None:
        return None


class _Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []

    async def send_all(self, outs: Sequence[tuple[str, bytes, bytes]]) -> None:
        self.sent.extend(outs)

    async def send(self, topic: str, key: bytes, value: bytes) -> Any:
        raise AssertionError("send_all is used")


class _Replay(RouterService):
    """The service with the simulator's window inputs as its snapshots and ledger."""

    script: dict[float, _Window]

    async def _see(self, now: float, blind: bool) -> Sight:
        return Sight(list(self.script[now].views), [])

    async def _price(
        self,
        candidates: Sequence[Pending],
        now: float,
        blind: bool,
        read: Mapping[str, float] | None = None,
    ) -> Money:
        b = self.script[now].budget or Budget(window_usd=window_mod.UNLIMITED_USD)
        return Money(b, {}, {}, {})


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return time.perf_counter()

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.mark.parametrize(
    ("policy", "flood"),
    [("latency-aware", False), ("batch-ilp-sfs", False), ("latency-aware", True),
     ("batch-ilp-sfs", True)],
)  # fmt: skip
def test_service_and_simulator_windows_decide_alike(
    policy: str, flood: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, w = _cluster(), _workload(flood=flood)
    # the flood: shed past 120 waiting queries, or after waiting 0.8 x the SLO
    shedding: dict[str, Any] = {"shed_backlog": 120, "shed_after_slo": 0.8} if flood else {}
    ecfg = EvalConfig(window_s=0.05, max_batch=12, budget_usd_per_query=6e-4,
                      max_hold_s=1.5, budget_hold_s=0.3, **shedding)  # fmt: skip
    options: dict[str, Any] = {"deadline_ms": 60_000.0} if policy.startswith("batch") else {}

    def router() -> Router:
        return make_router(policy, RouterContext.build(cfg, _Quality()), **options)

    # ---- the simulator, recording its windows
    sim_trace, windows = _Trace(), list[_Window]()
    _record_rules(monkeypatch, evaluator_mod, sim_trace, w, windows)
    cluster = SimCluster(cfg, seed=0)
    real_views = cluster.views
    pending_views: list[list[InstanceView]] = []

    def sim_views() -> list[InstanceView]:
        vs = real_views()
        pending_views.append(vs)
        return vs

    cluster.views = sim_views  # type: ignore[method-assign]

    def on_decide(budget: Budget) -> None:
        windows[-1].budget = budget

    res = evaluate(_Recording(router(), sim_trace, on_decide), cluster, w, ecfg)
    assert len(pending_views) == len(windows)
    for win, vs in zip(windows, pending_views, strict=True):
        win.views = vs

    # ---- the same windows through the service
    svc_trace = _Trace()
    _record_rules(monkeypatch, service_mod, svc_trace, w)
    clock = _Clock()
    monkeypatch.setattr(service_mod, "time", clock)
    sink = _Sink()
    rcfg = RouterConfig(window_s=ecfg.window_s, max_batch=ecfg.max_batch,
                        max_hold_s=ecfg.max_hold_s, budget_hold_s=ecfg.budget_hold_s,
                        **shedding)  # fmt: skip
    svc = _Replay(cfg, _Recording(router(), svc_trace), _Memory(), sink, rcfg)
    svc.script = {win.now: win for win in windows}
    row = {w.query_id(i): i for i in range(w.n)}

    async def replay() -> None:
        for n, win in enumerate(windows):
            clock.now = win.now
            items = [
                Inbound(w.query(row[q], ecfg.max_tokens).model_dump_json().encode(), "queries",
                        0, row[q], timestamp_s=float(w.arrival_s[row[q]]))  # fmt: skip
                for q in win.fresh
            ]
            if items:
                await svc.handle(items)
            else:
                assert await svc.retry_held() is not None, f"window {n}: nothing held"

    asyncio.run(replay())

    # ---- identical, window by window
    assert svc_trace.shed == sim_trace.shed
    assert svc_trace.admitted == sim_trace.admitted
    assert svc_trace.asked == sim_trace.asked
    assert svc_trace.settled == sim_trace.settled
    assert svc.held_count == 0
    # the exercise covered every rule
    reasons = {r for _, held, _ in sim_trace.settled for _, r in held}
    gave_up = {r for _, _, given in sim_trace.settled for _, r, _ in given}
    assert sum(len(r) for r, _, _ in sim_trace.settled) > 40
    assert {"budget"} <= reasons | gave_up, (reasons, gave_up)
    assert any(len(ids) > ecfg.max_batch for _, ids in sim_trace.admitted)  # the batch cut
    shed_ids = {q for _, _, gone in sim_trace.shed for q in gone}
    if flood:  # both rules fired: the backlog at the flood, the wait on held queries
        assert max(len(ids) for _, ids, _ in sim_trace.shed) > 120
        assert max(len(ids) for _, ids in sim_trace.admitted) <= 120
        assert len(shed_ids) > 150 and res.flags["shed"] == len(shed_ids)
    else:
        assert not shed_ids

    # ---- and the final outcome per query: what each world did with it
    routed_to: dict[str, str] = {}
    finals: dict[str, str] = {}
    codes: dict[str, str] = {}
    for topic, key, value in sink.sent:
        inst = topics.instance_of(topic)
        if inst:
            routed_to[key.decode()] = inst
        elif topic == topics.RESULTS:
            codes[key.decode()] = json.loads(value)["code"]
        elif topic == topics.DECISIONS:
            d = json.loads(value)
            if not d.get("reason", "").startswith("held for a later window"):
                finals[key.decode()] = d["status"]
    for i in range(w.n):
        qid = w.query_id(i)
        if res.served[i]:
            assert routed_to.get(qid) == res.instance_ids[int(res.instance[i])], qid
        else:
            assert qid not in routed_to
            want = {1: DecisionStatus.DEFERRED, 2: DecisionStatus.REJECTED}[int(res.status[i])]
            assert finals[qid] == want.value, qid
    # a budget give-up reaches the user as such (the gateway's 429 insufficient_quota)
    budget_given_up = {q for _, _, given in svc_trace.settled for q, r, _ in given if r == "budget"}
    assert set(codes) == {q for q, st in finals.items() if st != "routed"}
    for q, code in codes.items():
        want_code = "shed" if q in shed_ids else "not_routed"
        assert code == ("insufficient_quota" if q in budget_given_up else want_code), q
    shed_why = {json.loads(v)["reason"].split(" ")[1] for t, _, v in sink.sent
                if t == topics.DECISIONS and json.loads(v).get("reason", "").startswith("shed:")}  # fmt: skip
    if flood:  # both kinds: "shed: waited …" and "shed: <backlog> queries waiting …"
        assert "waited" in shed_why and any(x.isdigit() and int(x) > 120 for x in shed_why)
    else:
        assert not shed_why
    if policy == "latency-aware" and not flood:
        assert budget_given_up
