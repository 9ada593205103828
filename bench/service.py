"""Benchmark of the streaming service (issue 7, item 9): Kafka → router → instance topics.

    .venv/bin/python bench/service.py --quick      # < 120 s, one JSON object on stdout
    .venv/bin/python bench/service.py              # longer run, the figures of docs/benchmarks/service.md
    .venv/bin/python bench/service.py --flood 10000 --policy batch-ilp-sfs   # lag in a flood

Starts local Kafka and Redis (switchyard/services.py) when SWITCHYARD_KAFKA/REDIS are not
set, and stops only what it started. Runs ``switchyard router`` processes (subprocesses,
stopped by pid) on a cluster of ``--instances`` instances, produces queries at
``--rate`` per second (0: as fast as the producer goes) for ``--duration-s`` seconds,
and plays discarding workers: it reads every ``route.<instance>`` topic and frees each
query's capacity slot (one call per instance per batch), so capacity never binds.

Figures: ``routed_per_s`` = routed messages / (last routed − first routed), over the
steady part of the run; ``added_ms`` = Kafka timestamp of the routed message − Kafka
timestamp of the query (produce → routed), p50/p99 over every query.

``--flood N`` (issue 12, item 5): N queries sent at once to a fresh router, ``--flood-runs``
times without load shedding and as often with it (``--shed-after-slo``, ``--shed-backlog``:
``switchyard router``'s options), interleaved. Each query is finished when it is routed or
answered by the router (an error Result: ``shed`` or another code); the bench samples the
lag (queries sent and not finished: in Kafka or in the router) every 50 ms and reports its
maximum and the time to drain (first send → last query finished), the routed queries'
added latency p50/p99, how many were shed and how long a shed query waited for its answer
(p99); then the median of the runs for each side, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # noqa: E402

from switchyard import services  # noqa: E402
from switchyard.processes import ProcessGroup  # noqa: E402
from wiring import kafka_admin, topics  # noqa: E402

SMALL, LARGE = "qwen2.5-7b-instruct", "llama3-chatqa-1.5-70b"  # names the demo predictor knows
SLO_MS = 2000  # every benchmark query's TTFT SLO
BROKER_PID: list[int] = []  # the single Kafka broker's pid when known (its CPU per query)


def cluster_spec(rid: str, n_instances: int) -> dict[str, object]:
    return {
        "models": [
            {
                "name": SMALL,
                "profile": "llama-2-7b-hf@h100",
                "input_usd_per_token": 2e-7,
                "output_usd_per_token": 2e-7,
                "max_concurrency": 65536,
            },
            {
                "name": LARGE,
                "profile": "llama-2-70b-hf@h100",
                "input_usd_per_token": 9e-7,
                "output_usd_per_token": 9e-7,
                "max_concurrency": 65536,
            },
        ],  # fmt: skip
        "instances": [
            {"id": f"{rid}-{i}", "model": SMALL if i % 2 == 0 else LARGE}
            for i in range(n_instances)
        ],
        "tenants": [{"tenant": "default", "budget_usd": 1e6, "period_s": 86400}],
    }


def _primary_infos(url: str, section: str) -> list[dict[str, Any]]:
    """``INFO section`` of the Redis server, or of each primary of a cluster URL."""
    import redis

    from state.cluster import is_cluster_url, parse_cluster_url

    cluster = is_cluster_url(url)
    urls = [f"redis://{h}:{p}/0" for h, p in parse_cluster_url(url).nodes] if cluster else [url]
    out: list[dict[str, Any]] = []
    for u in urls:
        client = redis.Redis.from_url(u, socket_timeout=5)
        try:
            if cluster and client.info("replication").get("role") != "master":
                continue
            out.append(client.info(section))
        finally:
            client.close()
    return out


def redis_commands(url: str) -> int:
    """Commands processed so far by the Redis server, or by every primary of a cluster URL."""
    return sum(int(info["total_commands_processed"]) for info in _primary_infos(url, "stats"))


def redis_cpu_s(url: str) -> float:
    """User + system CPU seconds of the Redis server (``INFO cpu``; a cluster's primaries)."""
    infos = _primary_infos(url, "cpu")
    return sum(float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos)


def redis_commandstats(url: str) -> dict[str, int]:
    """Calls per command so far (``INFO commandstats``; summed over a cluster's primaries);
    a script's own calls count under their commands."""
    total: dict[str, int] = {}
    for info in _primary_infos(url, "commandstats"):
        for name, stats in info.items():
            cmd = name.removeprefix("cmdstat_")
            total[cmd] = total.get(cmd, 0) + int(stats["calls"])
    return total


async def heartbeat_loop(store: object, spec: dict[str, object], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for inst in spec["instances"]:  # type: ignore[attr-defined]
            await store.heartbeat(inst["id"], inst["model"], 10.0, 65536)  # type: ignore[attr-defined]
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def produce(
    bootstrap: str, ids: list[str], rate: float, sent_at: dict[bytes, float]
) -> float:
    """Produce one query per id at ``rate``/s (0: flat out); returns the wall time it took."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=2,
        max_batch_size=256 * 1024,
    )
    await producer.start()
    t0 = time.monotonic()
    try:
        pending = []
        for i, qid in enumerate(ids):
            body = f'{{"id":"{qid}","prompt":"benchmark query number {i} about trains","ttft_slo_ms":{SLO_MS}}}'
            key = qid.encode()
            sent_at[key] = time.time()
            pending.append(await producer.send(topics.QUERIES, body.encode(), key=key))
            if rate > 0 and i % 20 == 19:
                ahead = (i + 1) / rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return time.monotonic() - t0


async def discard(
    consumer: AIOKafkaConsumer, store: object, n: int, timeout_s: float, sent_at: dict[bytes, float]
) -> tuple[list[float], list[float], list[float]]:
    """Read route topics until ``n`` of ``sent_at``'s queries came; free their slots.

    Returns (routed timestamps s, added latency ms, sent timestamps s) of those queries.
    """
    routed_at: list[float] = []
    added_ms: list[float] = []
    sent_s: list[float] = []
    deadline = time.monotonic() + timeout_s
    while len(routed_at) < n and time.monotonic() < deadline:
        batch = await consumer.getmany(timeout_ms=500, max_records=10000)
        for tp, records in batch.items():
            inst = topics.instance_of(tp.topic)
            ids = []
            for r in records:
                t_sent = sent_at.pop(r.key, None)
                if t_sent is None:
                    continue
                ids.append(r.key.decode())
                routed_at.append(r.timestamp / 1000.0)
                added_ms.append(r.timestamp - t_sent * 1000.0)
                sent_s.append(t_sent)
            if ids and inst:
                await store.release_slots(inst, ids)  # type: ignore[attr-defined]
    return routed_at, added_ms, sent_s


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


async def phase(
    bootstrap: str,
    store: object,
    consumer: AIOKafkaConsumer,
    rid: str,
    tag: str,
    n: int,
    rate: float,
) -> dict[str, Any]:
    ids = [f"{rid}-{tag}-{i}" for i in range(n)]
    sent_at: dict[bytes, float] = {}
    prod = asyncio.create_task(produce(bootstrap, ids, rate, sent_at))
    routed_at, added, sent_s = await discard(
        consumer, store, n, 120.0 + (n / rate if rate else n / 100.0), sent_at
    )
    produce_s = await prod
    ts = sorted(routed_at)
    # steady part: drop the first and last 5% of routed messages (start-up and drain)
    lo, hi = int(len(ts) * 0.05), max(int(len(ts) * 0.95) - 1, 0)
    span = ts[hi] - ts[lo] if hi > lo else float("nan")
    return {
        "sent": n,
        "routed": len(routed_at),
        "offered_per_s": n / produce_s if produce_s > 0 else float("nan"),
        "routed_per_s": (hi - lo) / span if span and span > 0 else float("nan"),
        "added_ms_p50": pct(added, 50),
        "added_ms_p99": pct(added, 99),
        # p99 of the queries sent in each second of the phase: flat when the routers keep
        # up, growing when a backlog builds
        "added_ms_p99_by_s": _by_second(sent_s, added, 99),
    }


def _by_second(sent_s: list[float], added_ms: list[float], q: float) -> list[float]:
    """The ``q``-th percentile of ``added_ms`` per second of ``sent_s`` (from the first)."""
    if not sent_s:
        return []
    sent, added = np.asarray(sent_s), np.asarray(added_ms)
    second = (sent - sent.min()).astype(int)
    return [
        round(float(np.percentile(added[second == k], q)), 1)
        for k in range(int(second.max()) + 1)
        if (second == k).any()
    ]


def bench_setup(
    prefix: str, args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path
) -> tuple[str, dict[str, object], Path, ProcessGroup, list[str]]:
    """A fresh run id, its cluster (written under ``home``), a process group whose children
    reach Kafka and Redis in the run's namespace, and the routers' policy arguments."""
    rid = prefix + uuid.uuid4().hex[:6]
    spec = cluster_spec(rid, args.instances)
    cluster_file = home / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    env = dict(
        os.environ,
        SWITCHYARD_KAFKA=bootstrap,
        SWITCHYARD_REDIS=redis_url,
        SWITCHYARD_NAMESPACE=f"bench{rid}",
    )
    policy_args: list[str] = ["--policy", args.policy]
    if ":" not in args.policy:
        from offline.demo_predictor import ensure_predictor

        policy_args += ["--predictor", str(ensure_predictor())]
    return rid, spec, cluster_file, ProcessGroup(home / "logs", env=env), policy_args


def reader(bootstrap: str, names: list[str], group: str, reset: str) -> AIOKafkaConsumer:
    """The bench's consumer of ``names`` (large fetches: it must keep up with a flood)."""
    return AIOKafkaConsumer(
        *names,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset=reset,
        enable_auto_commit=False,
        fetch_max_bytes=32 * 1024 * 1024,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_min_bytes=64 * 1024,
        fetch_max_wait_ms=20,
    )


def start_routers(
    procs: ProcessGroup,
    args: argparse.Namespace,
    cluster_file: Path,
    policy_args: list[str],
    app_id: str,
    extra: list[str] = [],  # noqa: B006 - read only
) -> list[Any]:
    """``--routers`` router subprocesses in one consumer group, started from the end of
    ``queries``; returns once each has its partitions."""
    options = {
        "--cluster": str(cluster_file),
        "--window-ms": str(args.window_ms),
        "--max-batch": str(args.max_batch),
        "--partitions": str(args.partitions),
        "--from": "latest",
        "--app-id": app_id,
    }
    argv = [*policy_args, *(x for kv in options.items() for x in kv), *extra]
    routers = [procs.switchyard(f"{app_id}-{k}", "router", *argv) for k in range(args.routers)]
    for r in routers:
        procs.wait_for_line(r, "assigned queries partitions", 120)
    return routers


async def flood_once(
    bootstrap: str, store: object, consumer: AIOKafkaConsumer, ids: list[str], timeout_s: float
) -> dict[str, Any]:
    """Send ``ids`` at once; follow each until routed or answered; sample the lag."""
    sent_at: dict[bytes, float] = {}
    finished = routed = shed = other = 0
    added: list[float] = []
    answered_ms: list[float] = []
    lag: list[tuple[float, int]] = []
    t0 = time.time()
    prod = asyncio.create_task(produce(bootstrap, ids, 0.0, sent_at))
    n = len(ids)

    async def sample() -> None:
        while True:  # handed to the producer, not yet routed or answered
            lag.append((time.time() - t0, len(sent_at)))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    last_s = t0
    deadline = time.monotonic() + timeout_s
    try:
        while finished < n and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=10000)
            for tp, records in batch.items():
                inst = topics.instance_of(tp.topic)
                freed = []
                for r in records:
                    t_sent = sent_at.pop(r.key, None)
                    if t_sent is None:
                        continue
                    finished += 1
                    last_s = max(last_s, r.timestamp / 1000.0)
                    if inst:
                        routed += 1
                        freed.append(r.key.decode())
                        added.append(r.timestamp - t_sent * 1000.0)
                    else:
                        code = json.loads(r.value).get("code")
                        shed += code == "shed"
                        other += code != "shed"
                        answered_ms.append(r.timestamp - t_sent * 1000.0)
                if freed and inst:
                    await store.release_slots(inst, freed)  # type: ignore[attr-defined]
    finally:
        sampler.cancel()
        await prod
    lag_max = max((b for _, b in lag), default=0)
    return {
        "sent": n,
        "routed": routed,
        "shed": shed,
        "other_errors": other,
        "lost": n - finished,
        "added_ms_p50": round(pct(added, 50), 1),
        "added_ms_p99": round(pct(added, 99), 1),
        "shed_answer_ms_p99": round(pct(answered_ms, 99), 1),
        "lag_max": lag_max,
        "drain_s": round(last_s - t0, 2),
        # the largest lag in each second from the first send
        "lag_per_s": [
            max((b for t, b in lag if int(t) == sec), default=0)
            for sec in range(min(60, int(lag[-1][0]) + 1 if lag else 0))
        ],
    }


async def flood_lag(
    args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path
) -> dict[str, object]:
    """``--flood N``: the lag of a fresh router in an N-query flood, without and with
    shedding, ``--flood-runs`` times each, interleaved."""
    from state import StateStore

    rid, spec, cluster_file, procs, policy_args = bench_setup("f", args, bootstrap, redis_url, home)
    ns = f"bench{rid}"
    shedding = ["--shed-after-slo", str(args.shed_after_slo)]
    shedding += ["--shed-backlog", str(args.shed_backlog)]
    store = await StateStore.connect(redis_url, namespace=ns)
    stop = asyncio.Event()
    hb = asyncio.create_task(heartbeat_loop(store, spec, stop))
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "shed": []}
    load: list[float] = []
    try:
        instance_ids = [i["id"] for i in spec["instances"]]  # type: ignore[index]
        names = [topics.QUERIES, topics.RESULTS, *[topics.route(i) for i in instance_ids]]
        await kafka_admin.ensure_topics({"bootstrap_servers": bootstrap}, names, args.partitions)
        consumer = reader(bootstrap, names[1:], f"bench-flood-{rid}", "earliest")
        await consumer.start()
        try:
            for k in range(args.flood_runs):
                for side in ("off", "shed"):
                    app_id = f"router-{rid}-{side}{k}"
                    extra = shedding if side == "shed" else []
                    routers = await asyncio.to_thread(
                        start_routers, procs, args, cluster_file, policy_args, app_id, extra
                    )
                    await asyncio.sleep(2.0 if args.routers > 1 else 1.0)  # positions resolved
                    load.append(os.getloadavg()[0])
                    ids = [f"{rid}-{side}{k}-{i}" for i in range(args.flood)]
                    cpu_s = sum(_cpu_s(r.pid) for r in routers)
                    got = await flood_once(bootstrap, store, consumer, ids, 60.0 + args.flood / 200)
                    cpu_s = sum(_cpu_s(r.pid) for r in routers) - cpu_s
                    # the routers' CPU per query of the flood (routed or shed): what a shed saves
                    got["router_cpu_us_per_query"] = round(cpu_s / args.flood * 1e6, 1)
                    got["loadavg_1m_before"] = round(load[-1], 2)
                    runs[side].append(got)
                    for r in routers:
                        if not r.alive():
                            got["router_exit"] = r.tail(2000)
                        procs.stop(r)
                    print(json.dumps({side: got}), file=sys.stderr)
        finally:
            await consumer.stop()
    finally:
        stop.set()
        await hb
        procs.stop_all()
        await store.close()
    keys = ("added_ms_p50", "added_ms_p99", "lag_max", "drain_s", "shed", "shed_answer_ms_p99",
            "router_cpu_us_per_query")  # fmt: skip
    medians = {
        side: {key: float(np.median([r[key] for r in rs])) for key in keys}
        for side, rs in runs.items()
    }
    return {
        "flood": args.flood,
        "policy": args.policy,
        "routers": args.routers,
        "window_ms": args.window_ms,
        "max_batch": args.max_batch,
        "shedding": " ".join(shedding),
        "slo_ms": SLO_MS,
        "median": medians,
        "runs": runs,
        "loadavg_1m": [round(x, 2) for x in load],
        "cpus": os.cpu_count(),
    }


async def _route_ends(consumer: AIOKafkaConsumer, tps: list[Any]) -> int:
    """Sum of the end offsets of ``tps`` (every record a router produced to them so far)."""
    ends = await consumer.end_offsets(tps)
    return int(sum(ends.values()))


async def drain_once(
    args: argparse.Namespace,
    bootstrap: str,
    redis_url: str,
    store: object,
    procs: ProcessGroup,
    cluster_file: Path,
    policy_args: list[str],
    app_id: str,
    ids: list[str],
    routes: list[str],
) -> dict[str, Any]:
    """Routers read a backlog that was produced while they were stopped (SIGSTOP).

    The routers start and join their group on an empty ``queries``; then they are stopped,
    the backlog is produced, and they are resumed: from then on only the routers, the broker
    and Redis work (the bench polls the route topics' end offsets twice a second and reads
    the routed records afterwards). ``drain_per_s``: routed records over the time between
    the 5th and 95th percentile of their Kafka timestamps, as ``routed_per_s``."""
    routers = await asyncio.to_thread(start_routers, procs, args, cluster_file, policy_args, app_id)
    await asyncio.sleep(2.0 if args.routers > 1 else 0.5)  # the group settled
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await probe.start()
    try:
        from aiokafka import TopicPartition

        tps = [
            TopicPartition(t, p)
            for t in routes
            for p in (probe.partitions_for_topic(t) or await _partitions(probe, t))
        ]
        start = await probe.end_offsets(tps)
        for r in routers:
            os.kill(r.pid, signal.SIGSTOP)
        try:
            sent_at: dict[bytes, float] = {}
            produce_s = await produce(bootstrap, ids, 0.0, sent_at)
        finally:
            for r in routers:
                os.kill(r.pid, signal.SIGCONT)
        resumed = time.time()
        load = os.getloadavg()[0]
        cpu0 = sum(_cpu_s(r.pid) for r in routers)
        commands0 = redis_commandstats(redis_url)
        servers0 = redis_cpu_s(redis_url), sum(_cpu_s(p) for p in BROKER_PID)
        want = sum(start.values()) + len(ids)
        deadline = time.monotonic() + 60.0 + len(ids) / 200.0
        while await _route_ends(probe, tps) < want and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        cpu_s = sum(_cpu_s(r.pid) for r in routers) - cpu0
        commands1 = redis_commandstats(redis_url)
        servers1 = redis_cpu_s(redis_url), sum(_cpu_s(p) for p in BROKER_PID)
        exits = [r.tail(2000) for r in routers if not r.alive()]
        for r in routers:
            procs.stop(r)
        # the routed records, read after the drain (the bench took no CPU during it)
        routed_at: list[float] = []
        keys: set[bytes] = set()
        by_instance: dict[str, list[str]] = {}
        mine = {i.encode() for i in ids}
        for tp in tps:
            probe.assign([tp])
            probe.seek(tp, start[tp])
            end = (await probe.end_offsets([tp]))[tp]
            while await probe.position(tp) < end:
                got = await probe.getmany(tp, timeout_ms=1000, max_records=10000)
                for rec in got.get(tp, []):
                    routed_at.append(rec.timestamp / 1000.0)
                    keys.add(rec.key)
                    by_instance.setdefault(str(topics.instance_of(tp.topic)), []).append(
                        rec.key.decode()
                    )
        # free the capacity slots the routers took (no worker here): the next run's
        # instances start as empty as this one's did, and capacity never binds
        for instance_id, qids in by_instance.items():
            for at in range(0, len(qids), 5000):
                await store.release_slots(instance_id, qids[at : at + 5000])  # type: ignore[attr-defined]
    finally:
        await probe.stop()
    ts = sorted(routed_at)
    lo, hi = int(len(ts) * 0.05), max(int(len(ts) * 0.95) - 1, 0)
    span = ts[hi] - ts[lo] if hi > lo else float("nan")
    out: dict[str, Any] = {
        "sent": len(ids),
        "routed": len(ts),
        "routed_twice": len(ts) - len(keys),
        "lost": len(mine - keys),
        "drain_per_s": round((hi - lo) / span, 1) if span and span > 0 else float("nan"),
        "first_routed_after_resume_s": round(ts[0] - resumed, 3) if ts else float("nan"),
        "drain_s": round(ts[-1] - resumed, 2) if ts else float("nan"),
        "produce_per_s": round(len(ids) / produce_s, 1),
        "router_cpu_us_per_query": round(cpu_s / max(1, len(ts)) * 1e6, 1),
        # the servers' CPU over the drain per routed query (the broker's: NaN when unknown)
        "redis_cpu_us_per_query": round((servers1[0] - servers0[0]) / max(1, len(ts)) * 1e6, 1),
        "broker_cpu_us_per_query": round((servers1[1] - servers0[1]) / max(1, len(ts)) * 1e6, 1)
        if BROKER_PID
        else float("nan"),
        # Redis calls during the drain per routed query, by command (EVALSHA: one script
        # call; the script's own calls under their names), the bench's heartbeats included
        "redis_per_query": {
            cmd: round((n - commands0.get(cmd, 0)) / max(1, len(ts)), 3)
            for cmd, n in sorted(commands1.items())
            if n - commands0.get(cmd, 0) > 0 and cmd not in ("info",)
        },
        "loadavg_1m_at_resume": round(load, 2),
    }
    if exits:
        out["router_exit"] = exits
    return out


async def _grow_queries(bootstrap: str, partitions: int) -> None:
    """``queries`` with at least ``partitions`` partitions (a broker kept warm across runs
    of several partition counts: a fresh broker runs its first minutes slowly)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewPartitions

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        meta = await admin.describe_topics([topics.QUERIES])
        have = len(meta[0]["partitions"])
        if have > partitions:
            raise SystemExit(
                f"bench: {topics.QUERIES} has {have} partitions, more than --partitions "
                f"{partitions}; use a fresh broker (unset SWITCHYARD_KAFKA)"
            )
        if have < partitions:
            await admin.create_partitions({topics.QUERIES: NewPartitions(total_count=partitions)})
    finally:
        await admin.close()


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer._client.force_metadata_update()  # noqa: SLF001 - a topic just created
    return consumer.partitions_for_topic(topic) or set()


async def drain(
    args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path
) -> dict[str, object]:
    """``--drain N``: the routers' own rate on an N-query backlog (``drain_once``), for each
    router count of ``--routers-list`` (default ``--routers``), ``--drain-runs`` times each,
    interleaved; medians and the load average."""
    from state import StateStore

    rid, spec, cluster_file, procs, policy_args = bench_setup("d", args, bootstrap, redis_url, home)
    store = await StateStore.connect(redis_url, namespace=f"bench{rid}")
    stop = asyncio.Event()
    hb = asyncio.create_task(heartbeat_loop(store, spec, stop))
    counts = [int(x) for x in args.routers_list.split(",")] if args.routers_list else [args.routers]
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    try:
        instance_ids = [i["id"] for i in spec["instances"]]  # type: ignore[index]
        routes = [topics.route(i) for i in instance_ids]
        await kafka_admin.ensure_topics(
            {"bootstrap_servers": bootstrap}, [topics.QUERIES, *routes], args.partitions
        )
        await _grow_queries(bootstrap, args.partitions)
        if args.drain_warmup:  # a broker just started runs its first minute slowly (JIT)
            ids = [f"{rid}-warmup-{i}" for i in range(args.drain_warmup)]
            args.routers = 1
            await drain_once(
                args, bootstrap, redis_url, store, procs, cluster_file, policy_args,
                f"router-{rid}-warmup", ids, routes,
            )  # fmt: skip
        for k in range(args.drain_runs):
            for n in counts:
                args.routers = n
                ids = [f"{rid}-r{n}k{k}-{i}" for i in range(args.drain)]
                got = await drain_once(
                    args, bootstrap, redis_url, store, procs, cluster_file, policy_args, f"router-{rid}-{n}-{k}",
                    ids, routes,
                )  # fmt: skip
                runs[n].append(got)
                print(json.dumps({"routers": n, **got}), file=sys.stderr)
    finally:
        stop.set()
        await hb
        procs.stop_all()
        await store.close()
    keys = ("drain_per_s", "router_cpu_us_per_query", "redis_cpu_us_per_query",
            "broker_cpu_us_per_query", "produce_per_s")  # fmt: skip
    return {
        "drain": args.drain,
        "policy": args.policy,
        "partitions": args.partitions,
        "instances": args.instances,
        "window_ms": args.window_ms,
        "max_batch": args.max_batch,
        "median": {
            str(n): {key: float(np.median([r[key] for r in rs])) for key in keys}
            for n, rs in runs.items()
        },
        "runs": {str(n): rs for n, rs in runs.items()},
        "cpus": os.cpu_count(),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }


def _core_text(window: int, i: int, repeat: bool) -> str:
    """Query ``i``'s prompt in window ``window`` of ``--core`` (the same in every window with
    ``repeat``)."""
    tail = "" if repeat else f" in window {window}"
    return f"benchmark query number {i} about trains{tail}"


class _Split:
    """CPU time (``process_time``) of the window's parts, by wrapping them in place.

    ``decide`` (``Router.decide``) holds ``prepare`` (the window's arrays), which holds
    ``quality`` (the quality predictor), which holds ``featurize`` and ``knn`` (the
    estimator's neighbours and replicate averages); then, for the batch policies,
    ``ttft_ilp`` (the ILP with its SFS TTFT cuts) and ``decisions`` (the ``Decision``
    objects); ``validate`` is the service's ``_validate`` (each query's
    ``schemas.parse_query``, its checks and body hash: timed once a window, since a timer
    around each query's parse cost ~0.6 µs a query of its own); ``redis`` and
    ``produce`` are the CPU time spent while awaiting a Redis call or a produce with its
    acks, the event loop's other work in those spans included (aiokafka's sender)."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}

    def reset(self) -> None:
        self.cpu_s = dict.fromkeys(self.cpu_s, 0.0)

    def _sync(self, name: str, fn: Any) -> Any:
        self.cpu_s[name] = 0.0

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.cpu_s[name] += time.process_time() - t0

        return timed

    def _async(self, name: str, fn: Any) -> Any:
        self.cpu_s[name] = 0.0

        async def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.process_time()
            try:
                return await fn(*a, **kw)
            finally:
                self.cpu_s[name] += time.process_time() - t0

        return timed

    def wrap(self, svc: Any, router: Any) -> None:
        router.decide = self._sync("decide", router.decide)
        ctx = getattr(router, "ctx", None) or getattr(getattr(router, "inner", None), "ctx", None)
        quality = getattr(ctx, "quality", None)
        if quality is not None:
            featurizer = getattr(quality, "featurizer", None)
            if featurizer is not None:
                featurizer.transform = self._sync("featurize", featurizer.transform)
            estimator = getattr(quality, "estimator", None)
            if estimator is not None:
                estimator.predict_replicates = self._sync("knn", estimator.predict_replicates)
            quality.predict = self._sync("quality", quality.predict)
        policy = getattr(router, "inner", router)
        policy_module = sys.modules.get(type(policy).__module__)
        for name, part in (
            ("prepare", "prepare"),
            ("solve_with_ttft_cuts", "ttft_ilp"),
            ("decisions", "decisions"),
        ):
            if policy_module is not None and hasattr(policy_module, name):
                setattr(policy_module, name, self._sync(part, getattr(policy_module, name)))
        svc._validate = self._sync("validate", svc._validate)
        svc.state._call = self._async("redis", svc.state._call)
        svc._produce = self._async("produce", svc._produce)


async def core(
    args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path
) -> dict[str, object]:
    """CPU cost per query of one router window, in-process (no Faust), real Redis and Kafka.

    ``process_time`` counts this process's CPU only, so the figure holds up on a loaded
    machine where wall-clock rates do not.
    """
    from aiokafka import AIOKafkaProducer

    from offline.blas import limit_blas_threads
    from schemas import ClusterConfig
    from state import StateStore, period_id
    from streams.app import BatchSink, quiet_gc
    from streams.policy import load_router
    from streams.service import Inbound, RouterConfig, RouterService

    if args.blas_threads:  # as `switchyard router --blas-threads` (default 1)
        limit_blas_threads(args.blas_threads)
    rid = "c" + uuid.uuid4().hex[:6]
    spec = ClusterConfig.model_validate(cluster_spec(rid, args.instances))
    predictor = None
    if ":" not in args.policy:
        from offline.demo_predictor import ensure_predictor

        predictor = ensure_predictor()
    router = load_router(args.policy, spec, predictor)
    store = await StateStore.connect(redis_url, namespace=f"bench{rid}")
    for inst in spec.instances:
        await store.heartbeat(inst.id, inst.model, 600.0, 65536)
    names = [topics.route(i.id) for i in spec.instances] + [
        topics.DECISIONS,
        topics.DEAD_LETTERS,
        topics.RESULTS,
    ]
    await kafka_admin.ensure_topics(
        {"bootstrap_servers": bootstrap}, names, partitions=args.partitions
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True,
                                max_batch_size=1024 * 1024, max_request_size=8 * 1024 * 1024)  # fmt: skip
    await producer.start()
    svc = RouterService(spec, router, store, BatchSink(producer), RouterConfig(max_batch=args.max_batch),
                        period_id=period_id)  # fmt: skip
    windows = args.windows + 1  # the first is a warm-up
    # unique texts per window unless --repeat-texts: memos keyed by text must not flatter it
    batches = [
        [
            Inbound(
                f'{{"id":"{rid}-{w}-{i}","prompt":"{_core_text(w, i, args.repeat_texts)}"}}'.encode(),
                topics.QUERIES,
                0,
                w * args.max_batch + i,
            )
            for i in range(args.max_batch)
        ]  # fmt: skip
        for w in range(windows)
    ]
    split = _Split()
    split.wrap(svc, router)
    await svc.handle(batches[0])  # warm-up (imports, script loading, metadata)
    quiet_gc()  # as the router does once its service is built (streams.app)
    split.reset()
    # --fresh-views: a heartbeat per instance before each window, on a connection of its own,
    # its CPU and wall time taken out of the figures
    hb_store = await StateStore.connect(redis_url, namespace=f"bench{rid}") if args.fresh_views else None
    hb_cpu = hb_wall = 0.0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t_cpu, t_wall = time.process_time(), time.perf_counter()
    for b in batches[1:]:
        if hb_store is not None:
            h_cpu, h_wall = time.process_time(), time.perf_counter()
            for inst in spec.instances:
                await hb_store.heartbeat(inst.id, inst.model, 600.0, 65536)
            hb_cpu += time.process_time() - h_cpu
            hb_wall += time.perf_counter() - h_wall
        await svc.handle(b)
    cpu = time.process_time() - t_cpu - hb_cpu
    wall = time.perf_counter() - t_wall - hb_wall
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    n = (windows - 1) * args.max_batch
    await producer.stop()
    await store.close()
    if hb_store is not None:
        await hb_store.close()
    return {
        "mode": "core",
        "policy": args.policy,
        "window_queries": args.max_batch,
        "repeat_texts": args.repeat_texts,
        "fresh_views": args.fresh_views,
        "blas_threads": args.blas_threads,
        "cpu_us_per_query": round(cpu / n * 1e6, 1),
        # CPU time (this process) of Router.decide; the window code is the rest
        "decide_cpu_us_per_query": round(split.cpu_s["decide"] / n * 1e6, 1),
        "window_cpu_us_per_query": round((cpu - split.cpu_s["decide"]) / n * 1e6, 1),
        "split_cpu_us_per_query": {k: round(v / n * 1e6, 1) for k, v in split.cpu_s.items()},
        "wall_us_per_query": round(wall / n * 1e6, 1),
        # fresh memory pages touched (minor page faults) per query: a freed large array's
        # pages given back to the system and faulted in again by the next window's
        "minor_faults_per_query": round(faults / n, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 120 s")
    ap.add_argument(
        "--queries", type=int, default=0, help="queries to send (default: quick 100k, full 400k)"
    )
    ap.add_argument(
        "--rate", type=float, default=0.0, help="queries/s to offer (0: as fast as possible)"
    )
    ap.add_argument("--routers", type=int, default=1)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--window-ms", type=float, default=50.0)
    ap.add_argument("--max-batch", type=int, default=2000)
    ap.add_argument(
        "--core", action="store_true", help="CPU per query of the window code, in-process"
    )
    ap.add_argument("--windows", type=int, default=11, help="--core: timed windows")
    ap.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="--core: numpy BLAS threads, as `switchyard router --blas-threads` (0: BLAS default)",
    )
    ap.add_argument(
        "--fresh-views",
        action="store_true",
        help="--core: heartbeat every instance before each window (outside the timed CPU), "
        "so that every window sees live state and takes the SFS TTFT cuts; without it, "
        "windows more than the router's stale_after_s (2 s) after the one heartbeat see "
        "stale views (LPS, no cuts), and how many do depends on the machine's speed",
    )
    ap.add_argument(
        "--repeat-texts",
        action="store_true",
        help="--core: the same 1,000 prompt texts in every window (else unique per window)",
    )
    ap.add_argument(
        "--policy", default="round-robin", help="a routing.policies name, or module:factory"
    )
    ap.add_argument(
        "--clusters",
        action="store_true",
        help="on a local 3-broker Kafka (replication 3, min ISR 2) and a Redis Cluster "
        "(3 primaries, 1 replica each) started and stopped here",
    )
    ap.add_argument(
        "--flood",
        type=int,
        default=0,
        help="N queries at once, without and with load shedding: lag and added latency",
    )
    ap.add_argument("--flood-runs", type=int, default=3, help="--flood: runs of each side")
    ap.add_argument(
        "--drain",
        type=int,
        default=0,
        help="N queries produced while the routers are stopped, then drained: their own rate",
    )
    ap.add_argument("--drain-runs", type=int, default=3, help="--drain: runs of each router count")
    ap.add_argument(
        "--drain-warmup", type=int, default=0, help="--drain: queries of an untimed drain first"
    )
    ap.add_argument(
        "--routers-list", default="", help="--drain: router counts to run in turn, e.g. 1,2,3"
    )
    ap.add_argument(
        "--shed-after-slo",
        type=float,
        default=0.5,
        help="--flood: the shedding side's `switchyard router --shed-after-slo`",
    )
    ap.add_argument(
        "--shed-backlog",
        type=int,
        default=0,
        help="--flood: the shedding side's `switchyard router --shed-backlog` (0: off)",
    )
    ap.add_argument(
        "--latency-rate",
        type=float,
        default=0.0,
        help="offered rate of the latency phase (0: 30%% of the measured throughput)",
    )
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=None))
    return 0


async def run(args: argparse.Namespace) -> dict[str, object]:
    """Use the running services (env or `switchyard services up`), else start ours and stop
    exactly those at the end, whatever happened (a failed start included)."""
    started: list[str] = []
    home = Path(tempfile.mkdtemp(prefix="switchyard-bench-"))
    bootstrap = os.environ.get("SWITCHYARD_KAFKA")
    redis_url = os.environ.get("SWITCHYARD_REDIS")
    kept = False
    try:
        if args.clusters:
            from switchyard import clusters

            started.append("clusters")
            redis_url = clusters.redis_cluster_url(
                clusters.redis_cluster_up(3, replicas=1, home=home)
            )
            bootstrap = ",".join(r.address for r in clusters.kafka_cluster_up(3, home=home))
            os.environ["SWITCHYARD_KAFKA_REPLICATION_FACTOR"] = "3"  # the routers' topics
        elif not bootstrap or not redis_url:
            recs = {n: r for n, r in services.load_records().items() if r.alive()}
            if "kafka" in recs and "redis" in recs and not bootstrap and not redis_url:
                bootstrap, redis_url = recs["kafka"].address, recs["redis"].address
                BROKER_PID.append(recs["kafka"].pid)
            else:
                if not redis_url:
                    started.append("redis")
                    redis_url = services.redis_up(home=home, port=services.free_port()).address
                if not bootstrap:
                    started.append("kafka")
                    broker = services.kafka_up(home=home, port=services.free_port())
                    bootstrap = broker.address
                    BROKER_PID.append(broker.pid)
        if bootstrap and not BROKER_PID:  # given by address: ours if `services up` started it
            recs = {n: r for n, r in services.load_records().items() if r.alive()}
            if "kafka" in recs and recs["kafka"].address == bootstrap:
                BROKER_PID.append(recs["kafka"].pid)
        mode = core if args.core else flood_lag if args.flood else drain if args.drain else flood
        out = await mode(args, bootstrap, redis_url, home)
        if "router_exit" in out:  # a router died: keep its logs
            kept = True
            out["logs"] = str(home / "logs")
        return out
    except BaseException:
        kept = True
        print(f"bench: logs kept in {home}", file=sys.stderr)
        raise
    finally:
        if "clusters" in started:
            from switchyard import clusters

            clusters.down(home)
        elif started:
            services.down(home, names=started)
        if not kept:
            shutil.rmtree(home, ignore_errors=True)


async def flood(
    args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path
) -> dict[str, object]:
    """Routers as subprocesses, a flood then a latency phase (the end-to-end figures)."""
    from state import StateStore

    rid, spec, cluster_file, procs, policy_args = bench_setup("b", args, bootstrap, redis_url, home)
    ns, policy = f"bench{rid}", args.policy
    store = await StateStore.connect(redis_url, namespace=ns)
    stop = asyncio.Event()
    hb = asyncio.create_task(heartbeat_loop(store, spec, stop))
    n_through = args.queries or (10_000 if args.quick else 100_000)
    n_latency = 3_000 if args.quick else 20_000
    out: dict[str, object] = {}
    try:
        routers = await asyncio.to_thread(
            start_routers, procs, args, cluster_file, policy_args, f"router-{rid}"
        )
        await asyncio.sleep(2.0 if args.routers > 1 else 0.5)  # let a multi-router group settle
        instance_ids = [i["id"] for i in spec["instances"]]  # type: ignore[index]
        routes = [topics.route(i) for i in instance_ids]
        consumer = reader(bootstrap, routes, f"bench-discard-{rid}", "earliest")
        await consumer.start()
        try:
            commands_before = redis_commands(redis_url)
            cpu_before = sum(_cpu_s(r.pid) for r in routers)
            through = await phase(bootstrap, store, consumer, rid, "t", n_through, 0.0)
            router_cpu_s = sum(_cpu_s(r.pid) for r in routers) - cpu_before
            commands = redis_commands(redis_url) - commands_before
            # latency at a load the router sustains: 30% of the measured throughput
            lat_rate = args.latency_rate or max(
                100.0, round(0.3 * float(through["routed_per_s"]), -2)
            )
            latency = await phase(bootstrap, store, consumer, rid, "l", n_latency, lat_rate)
        finally:
            await consumer.stop()
        out = {
            "routed_per_s": round(float(through["routed_per_s"]), 1),
            "added_ms_p50": round(float(latency["added_ms_p50"]), 1),
            "added_ms_p99": round(float(latency["added_ms_p99"]), 1),
            "window_ms": args.window_ms,
            "latency_offered_per_s": round(float(latency["offered_per_s"]), 1),
            "added_ms_p99_by_s": latency["added_ms_p99_by_s"],
            "flood_added_ms_p99": round(float(through["added_ms_p99"]), 1),
            "queries": {"throughput": through["routed"], "latency": latency["routed"]},
            "routers": args.routers,
            # every command any client sent the Redis primaries during the flood, per routed
            # query (routers, the discarding workers' slot releases, heartbeats)
            "redis_commands_per_query": round(commands / max(1, int(through["routed"])), 2),
            # the routers' own CPU time (user + system) during the flood, per routed query:
            # beside --core's figure, what Faust and the consumer add per event
            "router_cpu_us_per_query": round(
                router_cpu_s / max(1, int(through["routed"])) * 1e6, 1
            ),
            "kafka": "3 brokers, replication 3, min.insync.replicas 2"
            if args.clusters
            else "1 broker",
            "redis": "Redis Cluster, 3 primaries + 3 replicas" if args.clusters else "1 server",
            "partitions": args.partitions,
            "instances": args.instances,
            "max_batch": args.max_batch,
            "policy": policy,
            "cpus": os.cpu_count(),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        }
        for r in routers:
            if not r.alive():
                out["router_exit"] = r.tail(2000)
    finally:
        stop.set()
        await hb
        procs.stop_all()
        await store.close()
    return out


if __name__ == "__main__":
    sys.exit(main())
