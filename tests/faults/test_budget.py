"""Scenario 7 — adversarial budget: bursts of the most expensive queries never overspend.

The product's default policy (``batch-ilp-sfs`` with a quality predictor trained on the
vendored routing data, cached under ``$SWITCHYARD_HOME``) routes bursts of the priciest
queries it can be sent — long prompts, ``max_tokens`` 1,024, a generous SLO — for a tenant
whose budget covers a small fraction of them, on the demo's three-tier cluster with real
``switchyard worker --backend sim`` processes that settle actual costs. A sampler reads
the tenant's ledger (``StateStore.budget_status``, one MULTI/EXEC read) every few
milliseconds throughout: reserved + spent must never exceed the limit at any sample, and
the sum of the published results' ``cost_usd`` must not either. Every query gets exactly
one ``Result`` (routed ones from a worker, the rest from the router after ``max_hold_s``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fault_harness import (
    POLICY_NOTES,
    OwnedServices,
    Proc,
    Procs,
    TopicReader,
    await_until,
    demo_cluster_spec,
    produce_all,
    product_policy,
    service_env,
    start_router,
    wait_router_ready,
    wait_until,
    write_cluster,
    write_figures,
)

from wiring.settings import Settings

pytestmark = pytest.mark.faults

BUDGET_USD = 0.02
TENANT = "burst"
N_BURSTS = 4
BURST = 150
MAX_TOKENS = 1024
PROMPT_CHARS = 4_000  # ~1,000 prompt tokens
TIME_SCALE = 50.0
MEASURED: dict[str, Any] = {}  # the burst test's figures, for the requirement tests below


@dataclass
class Rig:
    owned: OwnedServices
    procs: Procs
    settings: Settings
    cluster: Any
    router: Proc
    policy: str
    predictor_note: str


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("budget")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    try:
        prefix = "b" + uuid.uuid4().hex[:5]
        cluster_file = home / "cluster.json"
        cluster = write_cluster(
            cluster_file, demo_cluster_spec(prefix, {TENANT: BUDGET_USD, "default": 1e6})
        )
        env = service_env(owned, namespace=prefix)
        procs = Procs(home / "logs", env)
        policy, extra, note = product_policy(cluster)
        extra = [*extra, "--max-hold-s", "3"]
        router = start_router(procs, cluster_file, policy, window_ms=100, extra=extra, wait_s=0)
        for inst in cluster.instances:
            procs.start(
                f"worker-{inst.id}",
                [
                    "worker", "--instance", inst.id, "--cluster", str(cluster_file),
                    "--backend", "sim", "--time-scale", f"{TIME_SCALE:g}",
                    "--heartbeat-s", "0.5", "--log-level", "WARNING",
                ],
            )  # fmt: skip
        wait_router_ready(router, 120)
        settings = Settings.from_env(env)

        def alive() -> bool:
            from fault_harness import HarnessError

            for p in procs.started:
                if not p.alive():
                    raise HarnessError(f"{p.name} exited {p.popen.returncode}:\n{p.tail()}")
            return all(asyncio.run(_alive(settings, [i.id for i in cluster.instances])))

        wait_until(alive, 90, "the demo cluster's workers to heart-beat", poll_s=0.3)
        yield Rig(owned, procs, settings, cluster, router, policy, note)
    finally:
        if procs is not None:
            procs.stop_all()
        owned.down()


async def _alive(settings: Settings, ids: list[str]) -> list[bool]:
    from state.store import StateStore

    store = await StateStore.connect(**settings.redis_kwargs(), socket_timeout_s=3.0)
    try:
        live = await store.snapshots(ids, time.time())
        return [bool(live[i].alive) if i in live else False for i in ids]
    finally:
        await store.close()


class LedgerSampler:
    """Reads one tenant's ledger as fast as Redis answers; keeps the worst sample."""

    def __init__(self, settings: Settings, tenant: str, period: str, limit_usd: float) -> None:
        self.settings = settings
        self.tenant = tenant
        self.period = period
        self.limit_usd = limit_usd
        self.samples = 0
        self.max_committed_usd = 0.0
        self.max_spent_usd = 0.0
        self.over: list[tuple[float, float, float]] = []  # (t, reserved, spent)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LedgerSampler:
        from state.store import StateStore

        self._store = await StateStore.connect(**self.settings.redis_kwargs())
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 10)
        await self._store.close()

    async def _run(self) -> None:
        while not self._stop.is_set():
            st = await self._store.budget_status(self.tenant, self.period)
            self.samples += 1
            committed = st.reserved_usd + st.spent_usd
            self.max_committed_usd = max(self.max_committed_usd, committed)
            self.max_spent_usd = max(self.max_spent_usd, st.spent_usd)
            if committed > self.limit_usd + 1e-9:
                self.over.append((time.time(), st.reserved_usd, st.spent_usd))
            await asyncio.sleep(0.002)


async def test_bursts_of_expensive_queries_never_overspend(rig: Rig) -> None:
    from state import period_id

    run_id = "bx-" + uuid.uuid4().hex[:6]
    filler = ("explain the proof in detail " * (PROMPT_CHARS // 28 + 1))[:PROMPT_CHARS]
    ids: list[str] = []
    bursts: list[list[tuple[bytes, bytes]]] = []
    for b in range(N_BURSTS):
        burst = []
        for i in range(BURST):
            qid = f"{run_id}-{b}-{i}"
            ids.append(qid)
            body = (
                f'{{"id": "{qid}", "tenant": "{TENANT}", "prompt": "{i} {filler}", '
                f'"max_tokens": {MAX_TOKENS}, "ttft_slo_ms": 60000}}'
            )
            burst.append((qid.encode(), body.encode()))
        bursts.append(burst)
    period = period_id(time.time(), 3600)
    t0 = time.monotonic()
    async with (
        LedgerSampler(rig.settings, TENANT, period, BUDGET_USD) as sampler,
        TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader,
    ):
        for burst in bursts:
            await produce_all(rig.settings.kafka_kwargs(), "queries", burst)
            await asyncio.sleep(0.5)

        def all_answered() -> bool:
            rig.router.check_alive()
            return all(q in reader.tally.results for q in ids)

        try:
            await await_until(all_answered, 150, f"one result for each of {len(ids)} queries")
        except AssertionError as exc:
            missing = [q for q in ids if q not in reader.tally.results]
            where = [
                (
                    q,
                    [(d.get("status"), d.get("instance_id")) for d in reader.tally.decisions[q]],
                    [t for t, _ in reader.tally.routed.get(q, [])],
                )
                for q in missing[:4]
            ]
            pytest.fail(
                f"{exc}: {len(missing)} unanswered, e.g. (id, decisions, routed to) {where}; "
                f"processes: {[(p.name, p.popen.poll()) for p in rig.procs.started]}; "
                f"router log:\n{rig.router.tail(600)}"
            )
        await asyncio.sleep(1.0)  # late settles and duplicates
        elapsed = time.monotonic() - t0
        results = [r for q in ids for r in reader.tally.results.get(q, [])]
        ran = [r for r in results if not r.get("error")]
        result_cost = sum(float(r.get("cost_usd", 0.0)) for r in ran)
        reserved_cost = sum(
            float(d.get("predicted_cost_usd") or 0.0)
            for q in ids
            for d in reader.tally.ok_routed_decisions(q)
        )
        dup = [q for q in ids if len(reader.tally.results.get(q, [])) > 1]

    figures = {
        "policy": rig.policy,
        "policy_note": POLICY_NOTES.get("batch-ilp-sfs", rig.predictor_note),
        "budget_usd": BUDGET_USD,
        "queries_sent": len(ids),
        "bursts": N_BURSTS,
        "queries_run": len(ran),
        "queries_refused": len(results) - len(ran),
        "results_lost": 0,
        "duplicated_results": len(dup),
        "ledger_samples": sampler.samples,
        "max_committed_usd": round(sampler.max_committed_usd, 9),
        "max_spent_usd": round(sampler.max_spent_usd, 9),
        "samples_over_budget": len(sampler.over),
        "sum_result_cost_usd": round(result_cost, 9),
        "sum_reserved_usd": round(reserved_cost, 9),
        "elapsed_s": round(elapsed, 1),
        "command": "make test PYTEST_ARGS='tests/faults/test_budget.py'",
    }
    write_figures("7_adversarial_budget", figures)
    MEASURED.update(figures, over=sampler.over[:3])
    assert sampler.samples > 100, f"only {sampler.samples} ledger samples"
    assert not dup, f"{len(dup)} queries answered twice"


# Found by this scenario (spend reached 156 % of the budget: reservations used the policy's
# predicted output length while workers generated up to max_tokens); fixed in 397eae5
# (worst-case reservations, workers send that cap to the engine).
def test_ledger_never_over_budget_at_any_sample() -> None:
    if not MEASURED:
        pytest.skip("the burst test did not run")
    sampler_over = MEASURED["samples_over_budget"]
    result_cost = MEASURED["sum_result_cost_usd"]
    reserved_cost = MEASURED["sum_reserved_usd"]
    assert sampler_over == 0, (
        f"ledger over budget in {sampler_over} of {MEASURED['ledger_samples']} samples; worst "
        f"committed ${MEASURED['max_committed_usd']:.6f} > ${BUDGET_USD} (first: t, reserved, "
        f"spent = {MEASURED['over'][:1]}); results cost ${result_cost:.6f}, reserved at "
        f"decision ${reserved_cost:.6f}"
    )
    assert result_cost <= BUDGET_USD + 1e-9, (
        f"results cost ${result_cost:.6f} > budget ${BUDGET_USD} (reserved ${reserved_cost:.6f})"
    )
