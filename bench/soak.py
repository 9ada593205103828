"""Soak (issue 16): a long run at half of the measured peak through real Kafka and Redis.

    .venv/bin/python bench/soak.py                       # 30 min (make soak)
    .venv/bin/python bench/soak.py --duration-s 180 --warmup-s 60   # a short check

Starts its own Kafka broker and Redis (switchyard/services.py) in a temporary folder and
stops exactly those at the end. Runs the real ``switchyard router`` with the default policy
(``batch-ilp-sfs`` with the demo's quality predictor) and one ``switchyard worker --backend
sim`` per instance of the demo's three-tier cluster (configs/demo-cluster.yaml).

1. **Peak.** A flood of ``--peak-queries`` queries, produced as fast as the producer goes;
   the peak is the rate of results over the middle 80 % of that flood.
2. **Soak.** ``--duration-s`` seconds at ``--load`` (0.5) of that peak, paced. Every
   ``--sample-s`` seconds: resident set size (``VmRSS``) of the router and of every worker,
   consumer lag of the router group on ``queries`` and of each worker group on its
   ``route.<id>`` (end offsets − committed offsets), and results so far.
3. **Drain**, then counts: lost (sent, never a Result) and duplicated (a query id with more
   than one Result).

RSS growth compares the mean of the first and of the last ``--window-s`` seconds after the
warm-up (``--warmup-s``). Figures go to ``--out`` (JSON) and a plot to ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient  # noqa: E402

from offline.demo_predictor import ensure_predictor  # noqa: E402
from switchyard import services  # noqa: E402
from switchyard.processes import ProcessGroup  # noqa: E402
from wiring import kafka_admin, topics  # noqa: E402
from wiring.paths import REPO_ROOT  # noqa: E402

TIME_SCALE = 20.0  # the sim engines run this much faster than the H100 profiles


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def cluster_file(home: Path, prefix: str) -> tuple[Path, list[str]]:
    import yaml

    spec = yaml.safe_load((REPO_ROOT / "configs" / "demo-cluster.yaml").read_text())
    for inst in spec["instances"]:
        inst["id"] = f"{prefix}-{inst['id']}"
        inst.pop("endpoint", None)
    spec["tenants"] = [{"tenant": "default", "budget_usd": 1e6, "period_s": 86400}]
    path = home / "cluster.json"
    path.write_text(json.dumps(spec))
    return path, [i["id"] for i in spec["instances"]]


class Results:
    """Counts Results per query id (read from the beginning of ``results``)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.count: Counter[str] = Counter()
        self.errors = 0
        self.at: list[float] = []  # wall time of each first Result
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False,
            auto_offset_reset="earliest", max_partition_fetch_bytes=4 * 1_048_576,
        )  # fmt: skip
        await consumer.start()
        try:
            await kafka_admin.ensure_topics({"bootstrap_servers": self.bootstrap}, [topics.RESULTS])
            tps = await kafka_admin.partitions(
                {"bootstrap_servers": self.bootstrap}, [topics.RESULTS]
            )
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while True:
                batch = await consumer.getmany(timeout_ms=500, max_records=20_000)
                now = time.time()
                for recs in batch.values():
                    for r in recs:
                        body = json.loads(r.value)
                        qid = body["query_id"]
                        if not self.count[qid]:
                            self.at.append(now)
                        self.count[qid] += 1
                        self.errors += bool(body.get("error"))
        finally:
            await consumer.stop()


async def produce(bootstrap: str, ids: list[str], rate: float | None, rng: random.Random) -> float:
    """One query per id, paced at ``rate``/s (None: flat out); returns seconds taken."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5
    )
    await producer.start()
    t0 = time.monotonic()
    try:
        pending = []
        for i, qid in enumerate(ids):
            words = rng.randint(20, 400)
            body = {
                "id": qid, "prompt": f"soak query {i}: " + "tell me about trains " * (words // 4),
                "max_tokens": rng.choice([16, 32, 64, 128]), "ttft_slo_ms": 20_000,
                "created_at": time.time(),
            }  # fmt: skip
            pending.append(
                await producer.send(topics.QUERIES, json.dumps(body).encode(), key=qid.encode())
            )
            if rate and i % 10 == 9:
                ahead = (i + 1) / rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if len(pending) >= 2000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return time.monotonic() - t0


async def lags(bootstrap: str, instance_ids: list[str], router_group: str) -> dict[str, int]:
    """End offset − committed offset, summed per group (router on queries, workers on route.*)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await admin.start()
    await consumer.start()
    try:
        groups = {"router": (router_group, topics.QUERIES)}
        groups |= {iid: (topics.worker_group(iid), topics.route(iid)) for iid in instance_ids}
        out: dict[str, int] = {}
        for name, (group, topic) in groups.items():
            committed = await admin.list_consumer_group_offsets(group)
            tps = await kafka_admin.partitions({"bootstrap_servers": bootstrap}, [topic])
            ends = await consumer.end_offsets(tps) if tps else {}
            out[name] = sum(
                max(0, end - (committed[tp].offset if tp in committed else 0))
                for tp, end in ends.items()
            )
        return out
    finally:
        await consumer.stop()
        await admin.close()


async def soak(
    args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path
) -> dict[str, Any]:
    prefix = "soak" + uuid.uuid4().hex[:4]
    cfile, instance_ids = cluster_file(home, prefix)
    env = dict(os.environ, SWITCHYARD_KAFKA=bootstrap, SWITCHYARD_REDIS=redis_url,
               SWITCHYARD_NAMESPACE=prefix)  # fmt: skip
    procs = ProcessGroup(home / "logs", env=env)
    predictor = ensure_predictor()
    app_id = f"soak-router-{prefix}"
    rng = random.Random(args.seed)
    figures: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    try:
        router = procs.switchyard(
            "router", "router", "--cluster", str(cfile), "--predictor", str(predictor),
            "--from", "latest", "--app-id", app_id, "--loglevel", "WARNING",
        )  # fmt: skip
        workers = [
            procs.switchyard(
                f"worker-{iid}",
                "worker",
                "--instance",
                iid,
                "--cluster",
                str(cfile),
                "--backend",
                "sim",
                "--time-scale",
                f"{TIME_SCALE:g}",
                "--log-level",
                "WARNING",
            )  # fmt: skip
            for iid in instance_ids
        ]
        await asyncio.to_thread(procs.wait_for_line, router, "assigned queries partitions", 120)
        results = Results(bootstrap)
        await results.start()
        await asyncio.sleep(3.0)

        # 1. peak: a flood, results/s over its middle 80 %
        flood = [f"{prefix}-peak-{i}" for i in range(args.peak_queries)]
        await produce(bootstrap, flood, None, rng)
        deadline = time.monotonic() + 600
        while (
            sum(1 for q in flood if results.count[q]) < len(flood) and time.monotonic() < deadline
        ):
            await asyncio.sleep(1.0)
        done_at = sorted(results.at)
        lo, hi = int(len(done_at) * 0.1), int(len(done_at) * 0.9) - 1
        peak = (hi - lo) / (done_at[hi] - done_at[lo])
        rate = args.load * peak
        figures.update(peak_results_per_s=round(peak, 1), soak_rate_per_s=round(rate, 1))
        print(f"soak: peak {peak:.1f} results/s; soaking at {rate:.1f}/s", flush=True)

        # 2. soak at a share of the peak, sampling RSS and lag
        n = int(rate * args.duration_s)
        ids = [f"{prefix}-soak-{i}" for i in range(n)]
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        sending = asyncio.create_task(produce(bootstrap, ids, rate, rng))
        while not sending.done():
            sample: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1)}
            sample["rss_mib"] = {"router": rss_mib(router.pid)}
            sample["rss_mib"] |= {
                iid: rss_mib(w.pid) for iid, w in zip(instance_ids, workers, strict=True)
            }
            try:
                sample["lag"] = await lags(bootstrap, instance_ids, app_id)
            except Exception as exc:  # noqa: BLE001 - a sample missed, not the run
                sample["lag_error"] = repr(exc)
            sample["answered"] = sum(1 for q in ids if results.count[q])
            sample["loadavg_1m"] = os.getloadavg()[0]
            samples.append(sample)
            for child in [router, *workers]:
                if not child.alive():
                    raise RuntimeError(f"{child.name} died:\n{child.tail()}")
            await asyncio.wait([sending], timeout=args.sample_s)
        await sending
        # 3. drain
        deadline = time.monotonic() + 300
        while sum(1 for q in ids if results.count[q]) < n and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        await asyncio.sleep(5.0)  # a duplicate Result would show now
        await results.stop()
        lost = [q for q in ids if not results.count[q]]
        dup = [q for q in ids if results.count[q] > 1]
        figures.update(
            sent=n, lost=len(lost), duplicated=len(dup), lost_examples=lost[:5],
            error_results=results.errors, duration_s=args.duration_s, warmup_s=args.warmup_s,
            samples=samples, loadavg_end=os.getloadavg(),
        )  # fmt: skip
        figures.update(growth(samples, args.warmup_s, args.window_s))
        return figures
    finally:
        procs.stop_all()


def growth(samples: list[dict[str, Any]], warmup_s: float, window_s: float) -> dict[str, Any]:
    """RSS growth per process (mean of the last window / mean of the first after warm-up) and
    the highest lag after warm-up."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if not after:
        return {}
    t_end = after[-1]["t_s"]
    first = [s for s in after if s["t_s"] < warmup_s + window_s]
    last = [s for s in after if s["t_s"] > t_end - window_s]
    out: dict[str, Any] = {"rss_growth": {}, "rss_mib_after_warmup": {}, "rss_mib_end": {}}
    for name in after[0]["rss_mib"]:
        a = [s["rss_mib"][name] for s in first if s["rss_mib"].get(name)]
        b = [s["rss_mib"][name] for s in last if s["rss_mib"].get(name)]
        if a and b:
            out["rss_growth"][name] = round(sum(b) / len(b) / (sum(a) / len(a)) - 1.0, 4)
            out["rss_mib_after_warmup"][name] = round(sum(a) / len(a), 1)
            out["rss_mib_end"][name] = round(sum(b) / len(b), 1)
    lag = [s["lag"] for s in after if "lag" in s]
    out["max_lag_after_warmup"] = {k: max(x[k] for x in lag) for k in lag[0]} if lag else {}
    return out


def plot(figures: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = figures["samples"]
    t = [s["t_s"] / 60.0 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name in samples[0]["rss_mib"]:
        ax1.plot(t, [s["rss_mib"].get(name) for s in samples], label=name.split("-", 1)[-1])
    ax1.axvline(figures["warmup_s"] / 60.0, color="grey", linestyle=":", label="end of warm-up")
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(fontsize=8)
    ax1.set_title(
        f"soak: {figures['sent']:,} queries at {figures['soak_rate_per_s']}/s "
        f"(50% of {figures['peak_results_per_s']}/s), lost {figures['lost']}, "
        f"duplicated {figures['duplicated']}",
        fontsize=9,
    )
    for name in samples[-1].get("lag", {}):
        ax2.plot(t, [s.get("lag", {}).get(name) for s in samples], label=name.split("-", 1)[-1])
    ax2.set_ylabel("consumer lag (messages)")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
    started: list[str] = []
    keep = False
    try:
        started.append("redis")
        redis_url = services.redis_up(home=home, port=services.free_port()).address
        started.append("kafka")
        bootstrap = services.kafka_up(home=home, port=services.free_port()).address
        return await soak(args, bootstrap, redis_url, home)
    except BaseException:
        keep = True
        print(f"soak: logs kept in {home}", file=sys.stderr)
        raise
    finally:
        services.down(home, names=started)
        if not keep:
            shutil.rmtree(home, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--warmup-s", type=float, default=300.0)
    ap.add_argument("--window-s", type=float, default=180.0, help="RSS averaging window")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--load", type=float, default=0.5, help="share of the measured peak")
    ap.add_argument("--peak-queries", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / ".switchyard" / "soak.json")
    ap.add_argument("--plot", type=Path, default=REPO_ROOT / ".switchyard" / "soak.png")
    args = ap.parse_args()
    figures = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    plot(figures, args.plot)
    summary = {k: v for k, v in figures.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    ok = (
        figures["lost"] == 0
        and figures["duplicated"] == 0
        and all(g <= 0.10 for g in figures.get("rss_growth", {}).values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
