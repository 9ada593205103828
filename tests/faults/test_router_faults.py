"""Router faults: scenario 6 (hostile input) and scenario 1 (``kill -9`` mid-replay).

One router rig per module: a broker and Redis this module owns, a real ``switchyard
router`` subprocess, instances heart-beaten by the test (no workers: these scenarios are
about the router alone; capacity is set high so nothing waits for a worker).

Scenario 6 — hostile input through the real router: never crashes, nothing bad slips through.

100,000 generated bad messages (``strategies.parse_bad_messages`` drawings, plus duplicate
ids with different bodies and unknown tenants) are interleaved at random with 3,000 valid
queries on ``queries``. The router (a real ``switchyard router`` subprocess on a broker and
Redis this module owns; the test heart-beats the instances) must stay up, put every bad
message in ``dead-letters`` with a reason (matched by source partition and offset), and
route every valid query exactly once. The throughput cost is the hostile stream's rate
against a clean stream's on the same router.

Scenario 1 — a 10,000-query replay (paced producer, as ``switchyard replay`` produces) with
the router ``kill -9``'d by pid at 40 % and restarted at once: every query routed, none
routed twice (route topics read end to end), recovery time measured.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fault_harness import (
    Heartbeats,
    OwnedServices,
    Procs,
    TopicReader,
    await_until,
    cluster_spec,
    policy_name,
    produce_all,
    router_ready,
    service_env,
    start_router,
    write_cluster,
    write_figures,
)
from strategies import (
    Hostile,
    duplicate_id_pairs,
    huge_prompts,
    parse_bad_messages,
    pool,
    unknown_tenant_queries,
)

from wiring.settings import Settings

pytestmark = pytest.mark.faults

N_BAD = 100_000
N_VALID = 3_000
N_CLEAN = 1_000
POOL = 1_500  # distinct hypothesis drawings the bad stream is built from
N_DUP_PAIRS = 300
N_UNKNOWN_TENANT = 300
SEED = 20261129


@dataclass
class Rig:
    owned: OwnedServices
    procs: Procs
    env: dict[str, str]
    settings: Settings
    cluster: Any
    router: Any
    policy: str


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("hostile")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    try:
        prefix = "h" + uuid.uuid4().hex[:5]
        cluster_file = home / "cluster.json"
        cluster = write_cluster(
            cluster_file,
            cluster_spec(prefix, max_concurrency=65_536, tenants={"default": 1e6, "acme": 1e6}),
        )
        env = service_env(owned, namespace=prefix)
        procs = Procs(home / "logs", env)
        policy = policy_name("round-robin", cluster)
        # no workers here (the test heart-beats the instances): nothing may re-route their
        # topics when it stops heart-beating between tests (streams.rescue)
        router = start_router(
            procs, cluster_file, policy, extra=["--max-batch", "2000", "--rescue-grace-s", "0"]
        )
        yield Rig(owned, procs, env, Settings.from_env(env), cluster, router, policy)
    finally:
        if procs is not None:
            procs.stop_all()
        owned.down()


def _valid(prefix: str, n: int, rng: random.Random) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        qid = f"{prefix}-{i}"
        if rng.random() < 0.5:
            body = f'{{"id": "{qid}", "prompt": "what is {i} + {i}?", "max_tokens": 16}}'
        else:
            body = (
                f'{{"id": "{qid}", "tenant": "acme", "ttft_slo_ms": 1500, '
                f'"messages": [{{"role": "user", "content": "hello {i}"}}], "max_tokens": 16}}'
            )
        out.append((qid.encode(), body.encode()))
    return out


async def _run_stream(
    rig: Rig,
    messages: list[tuple[bytes | None, bytes | None, str]],
    valid_ids: set[str],
    n_bad: int,
    reader: TopicReader,
    timeout_s: float,
) -> dict[str, Any]:
    """Produce ``messages`` (key, value, kind); wait for every valid id routed and every bad one dead-lettered."""
    letters_before = len(reader.tally.dead_letters)
    t0 = time.monotonic()
    offsets = await produce_all(
        rig.settings.kafka_kwargs(), "queries", [(k, v) for k, v, _ in messages]
    )
    produced_s = time.monotonic() - t0

    def done() -> bool:
        rig.router.check_alive()
        reader.check()
        routed = sum(1 for q in valid_ids if q in reader.tally.routed)
        return routed == len(valid_ids) and len(reader.tally.dead_letters) - letters_before >= n_bad

    try:
        await await_until(
            done, timeout_s, "every valid query routed and every bad one dead-lettered"
        )
    except AssertionError as exc:
        routed = sum(1 for q in valid_ids if q in reader.tally.routed)
        raise AssertionError(
            f"{exc}: routed {routed}/{len(valid_ids)} valid, dead letters "
            f"{len(reader.tally.dead_letters) - letters_before}/{n_bad}; router log tail:\n"
            f"{rig.router.tail(2000)}"
        ) from None
    elapsed = time.monotonic() - t0
    return {"offsets": offsets, "elapsed_s": elapsed, "produced_s": produced_s}


def _relabel(first: bytes, second: bytes, qid: str) -> tuple[bytes, bytes]:
    a, b = json.loads(first), json.loads(second)
    a["id"] = b["id"] = qid
    return json.dumps(a).encode(), json.dumps(b).encode()


async def test_hostile_stream_never_crashes_and_loses_nothing(rig: Rig) -> None:
    rng = random.Random(SEED)
    t_gen = time.monotonic()
    bad_pool = pool(parse_bad_messages(include_huge=False, max_depth=3_000, max_digits=6_000), POOL)
    bad_pool += [Hostile(b"", "empty"), Hostile(b" \n", "empty"), Hostile(None, "tombstone")] * 20
    huge = pool(huge_prompts(), 6)
    huge = [h for h in huge if h.raw is not None and len(h.raw) < 700_000]  # see test below
    dup_prefix = "dup-" + uuid.uuid4().hex[:4] + "-"
    dup_pairs = [  # one fresh id per pair: hypothesis may draw the same id twice
        _relabel(first, second, f"{dup_prefix}{n}")
        for n, (first, second) in enumerate(pool(duplicate_id_pairs(), N_DUP_PAIRS))
    ]
    unknown = pool(
        unknown_tenant_queries(id_prefix="unk-" + uuid.uuid4().hex[:4] + "-"), N_UNKNOWN_TENANT
    )
    gen_s = time.monotonic() - t_gen

    async with (
        Heartbeats(rig.settings.redis_kwargs(), rig.cluster),
        TopicReader(rig.settings.kafka_kwargs(), ["decisions", "dead-letters"]) as reader,
    ):
        # 1. a clean stream: the router's baseline rate on this machine
        clean = _valid("clean-" + uuid.uuid4().hex[:6], N_CLEAN, rng)
        clean_ids = {k.decode() for k, _ in clean}
        base = await _run_stream(
            rig, [(k, v, "valid") for k, v in clean], clean_ids, 0, reader, timeout_s=120
        )

        # 2. the hostile stream: bad, semantic-bad and valid messages interleaved at random
        valid = _valid("ok-" + uuid.uuid4().hex[:6], N_VALID, rng)
        valid_ids = {k.decode() for k, _ in valid}
        stream: list[tuple[bytes | None, bytes | None, str]] = [(k, v, "valid") for k, v in valid]
        seen_dup: set[str] = set()
        for first, _ in dup_pairs:
            qid = first.split(b'"id": "', 1)[1].split(b'"', 1)[0].decode()
            if qid in seen_dup or qid in valid_ids:
                continue
            seen_dup.add(qid)
            valid_ids.add(qid)
            stream.append((qid.encode(), first, "valid"))
        stream += [(b"unk", u, "unknown_tenant") for u in unknown]
        stream += [(b"huge", h.raw, h.kind) for h in huge]
        n_parse_bad = N_BAD - len(unknown) - len(huge) - len(seen_dup)
        stream += [
            (b"b%d" % i, bad_pool[i % len(bad_pool)].raw, bad_pool[i % len(bad_pool)].kind)
            for i in range(n_parse_bad)
        ]
        rng.shuffle(stream)
        # a conflicting second body comes after its first (a "duplicate id, different body")
        seconds = {
            first.split(b'"id": "', 1)[1].split(b'"', 1)[0].decode(): second
            for first, second in dup_pairs
        }
        stream += [(qid.encode(), seconds[qid], "duplicate_id") for qid in sorted(seen_dup)]
        kinds = Counter(kind for _, _, kind in stream)
        n_bad = len(stream) - kinds["valid"]
        assert n_bad >= N_BAD, f"only {n_bad} bad messages generated"

        run = await _run_stream(rig, stream, valid_ids, n_bad, reader, timeout_s=300)
        rig.router.check_alive()

        # every bad message has a dead letter with a reason, found by its source offset
        by_source: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for letter in reader.tally.dead_letters:
            if letter.get("topic") == "queries":
                by_source.setdefault((letter["partition"], letter["offset"]), []).append(letter)
        missing: Counter[str] = Counter()
        reasonless = 0
        dup_letters = 0
        for (key, _, kind), (part, off) in zip(stream, run["offsets"], strict=True):
            if kind == "valid":
                assert (part, off) not in by_source, (
                    f"valid query {key!r} was dead-lettered: {by_source[(part, off)][0]['reason']}"
                )
                continue
            letters = by_source.get((part, off))
            if not letters:
                missing[kind] += 1
                continue
            dup_letters += len(letters) - 1
            if not str(letters[0].get("reason", "")).strip():
                reasonless += 1
        assert not missing, f"bad messages with no dead letter, by kind: {dict(missing)}"
        assert reasonless == 0, f"{reasonless} dead letters without a reason"

        # every valid query routed exactly once
        lost, twice = reader.tally.ids_routed(valid_ids)
        assert not lost, f"{len(lost)} valid queries never routed, e.g. {sorted(lost)[:5]}"
        twice_here = twice & valid_ids
        assert not twice_here, f"{len(twice_here)} routed twice, e.g. {sorted(twice_here)[:5]}"
        reasons = Counter(
            str(letter.get("stage")) + ": " + str(letter.get("reason", ""))[:40]
            for letter in reader.tally.dead_letters
        )

    total = len(stream)
    clean_rate = N_CLEAN / base["elapsed_s"]
    hostile_rate = total / run["elapsed_s"]
    valid_rate = len(valid_ids) / run["elapsed_s"]
    write_figures(
        "6_hostile_input",
        {
            "policy": rig.policy,
            "bad_sent": n_bad,
            "bad_by_kind": dict(kinds - Counter({"valid": kinds["valid"]})),
            "valid_sent": len(valid_ids),
            "valid_lost": 0,
            "valid_routed_twice": 0,
            "bad_without_dead_letter": 0,
            "duplicate_dead_letters": dup_letters,
            "router_crashes": 0,
            "clean_queries_per_s": round(clean_rate, 1),
            "hostile_messages_per_s": round(hostile_rate, 1),
            "hostile_valid_routed_per_s": round(valid_rate, 1),
            "seconds_per_100k_bad": round(run["elapsed_s"] * 100_000 / total, 1),
            "generation_s": round(gen_s, 1),
            "produce_s": round(run["produced_s"], 1),
            "elapsed_s": round(run["elapsed_s"], 1),
            "top_reasons": reasons.most_common(8),
            "command": "make test PYTEST_ARGS='tests/faults/test_router_faults.py -k hostile'",
        },
    )


KILL9: dict[str, Any] = {}  # the replay test's figures, for the requirement test below
N_REPLAY = 10_000
REPLAY_RATE = 2_000.0  # queries/s
KILL_AT = 4_000


async def test_router_kill9_mid_replay_loses_nothing(rig: Rig) -> None:
    run_id = "rc-" + uuid.uuid4().hex[:6]
    ids = [f"{run_id}-{i}" for i in range(N_REPLAY)]
    messages = [
        (
            qid.encode(),
            f'{{"id": "{qid}", "prompt": "replayed query {i}", "max_tokens": 8}}'.encode(),
        )
        for i, qid in enumerate(ids)
    ]
    marks: dict[str, float] = {}
    restarted: list[Any] = []
    watchers: list[asyncio.Task[float]] = []

    async def watch_ready(proc: Any) -> float:
        await await_until(
            lambda: router_ready(proc),
            120,
            f"the restarted router (pid {proc.pid}) to own partitions",
        )
        marks["ready"] = time.monotonic()
        return marks["ready"]

    def on_sent(i: int) -> None:
        if i == KILL_AT:
            old = rig.router
            old.kill9()  # no shutdown hooks, no flush, no commit
            marks["killed"] = time.monotonic()
            marks["killed_wall"] = time.time()
            rig.router = rig.procs.start("router", old.argv[3:])  # python -m switchyard.cli ARGS
            restarted.append(rig.router)
            watchers.append(asyncio.get_running_loop().create_task(watch_ready(rig.router)))

    async with (
        Heartbeats(rig.settings.redis_kwargs(), rig.cluster),
        TopicReader(rig.settings.kafka_kwargs(), ["decisions"]) as reader,
    ):
        t0 = time.monotonic()
        await produce_all(
            rig.settings.kafka_kwargs(),
            "queries",
            messages,
            rate_per_s=REPLAY_RATE,
            on_sent=on_sent,
        )
        assert restarted, "the router was never killed"
        new = restarted[0]
        await watchers[0]

        def all_routed() -> bool:
            new.check_alive()
            reader.check()
            return all(q in reader.tally.routed for q in ids)

        try:
            await await_until(all_routed, 180, f"all {N_REPLAY} replayed queries routed")
        except AssertionError as exc:
            lost, _ = reader.tally.ids_routed(ids)
            pytest.fail(
                f"{exc}: {len(lost)} not routed, e.g. {sorted(lost)[:5]}; router log:\n{new.tail(1500)}"
            )
        drained = time.monotonic()
        await asyncio.sleep(2.0)  # anything routed twice would show up late
        lost, twice = reader.tally.ids_routed(ids)
        twice_ids = twice & set(ids)
        copies = sum(len(reader.tally.routed[q]) for q in ids)
        resent = reader.tally.resent_copies(ids)
        resent_ids = sum(1 for q in ids if len(reader.tally.routed[q]) > 1 and q not in twice_ids)
        routed_decisions = sum(len(reader.tally.ok_routed_decisions(q)) for q in ids)

    figures = {
        "policy": rig.policy,
        "queries_sent": N_REPLAY,
        "replay_rate_per_s": REPLAY_RATE,
        "killed_after_sent": KILL_AT,
        "lost": len(lost),
        "routed_twice": len(twice_ids),
        "route_messages": copies,
        "resent_copies": resent,
        "resent_queries": resent_ids,
        "routed_decisions": routed_decisions,
        "restart_to_partitions_s": round(marks["ready"] - marks["killed"], 1),
        "kill_to_all_routed_s": round(drained - marks["killed"], 1),
        "replay_elapsed_s": round(drained - t0, 1),
        "command": "make test PYTEST_ARGS='tests/faults/test_router_faults.py -k kill9'",
    }
    examples = []
    for qid in sorted(twice_ids, key=lambda q: int(q.rsplit("-", 1)[1]))[:4]:
        seen = [
            f"{topic} decided {body['decision']['decided_at'] - marks['killed_wall']:+.2f} s"
            for topic, body in reader.tally.routed[qid]
        ]
        examples.append(f"{qid}: {seen}")
    figures["route_duplicate_examples"] = examples
    write_figures("1_router_kill9", figures)
    KILL9.update(figures)
    assert not lost, f"{len(lost)} queries lost, e.g. {sorted(lost)[:5]}"


# Found by this suite: a router killed between Kafka's ack and the Redis "routed" mark left
# its window unmarked and the successor decided it again, often for another instance (104-785
# of 10,000). Fixed by recording the route intent before producing (streams/service.py): the
# successor re-sends the same decision to the same instance, where the worker drops the copy.
def test_router_kill9_routes_nothing_twice() -> None:
    if not KILL9:
        pytest.skip("the replay test did not run")
    assert KILL9["routed_twice"] == 0, (
        f"{KILL9['routed_twice']} queries routed twice, to another instance or with another "
        f"decision (in {KILL9['route_messages']} route messages for {N_REPLAY} queries, "
        f"{KILL9['resent_copies']} of them identical re-sends); times relative to the kill: "
        f"{KILL9['route_duplicate_examples']}"
    )


# Found by this test (the dead letter of a ~1 MB bad message exceeded the broker's limit and
# the window was retried forever); fixed in d2e156c (dead letters keep at most 256 KiB).
async def test_near_max_bad_message_does_not_stall_the_router(rig: Rig, tmp_path: Path) -> None:
    """A bad message just under the broker's size limit: its dead letter (base64, +33%) is
    larger than the broker accepts. It must still be answered, and the stream must go on."""
    big = b'{"id": "near-max", "prompt": "' + b"a" * 990_000 + b'"}'
    after = [(f"after-{i}-{uuid.uuid4().hex[:6]}".encode(), None) for i in range(50)]
    valid = [(k, f'{{"id": "{k.decode()}", "prompt": "still flowing"}}'.encode()) for k, _ in after]
    async with (
        Heartbeats(rig.settings.redis_kwargs(), rig.cluster),
        TopicReader(rig.settings.kafka_kwargs(), ["decisions", "dead-letters"]) as reader,
    ):
        offsets = await produce_all(
            rig.settings.kafka_kwargs(), "queries", [(b"near-max", big), *valid]
        )
        ids = {k.decode() for k, _ in valid}
        part, off = offsets[0]

        def answered() -> bool:
            rig.router.check_alive()
            routed = all(q in reader.tally.routed for q in ids)
            lettered = any(
                d.get("partition") == part and d.get("offset") == off
                for d in reader.tally.dead_letters
            )
            return routed and lettered

        try:
            await await_until(
                answered, 15, "the near-max bad message's dead letter and 50 valid queries after it"
            )
        except AssertionError as exc:
            routed = sum(1 for q in ids if q in reader.tally.routed)
            copies = sum(len(reader.tally.routed.get(q, [])) for q in ids)
            pytest.fail(
                f"{exc}: {routed}/50 later queries routed, in {copies} route messages. Was "
                "the dead letter of a bad message near the broker's 1 MB limit rejected "
                "(MessageSizeTooLargeError) and its window retried forever? (once the case: "
                "streams/service.py RouterService._dead_letter, fixed in d2e156c) Router log:\n"
                f"{rig.router.tail(800)}"
            )
        lost, twice = reader.tally.ids_routed(ids)
        assert not lost and not (twice & ids), f"lost {sorted(lost)}, twice {sorted(twice & ids)}"
