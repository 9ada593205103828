"""Latency the gateway adds over calling the engine directly, measured with ``hey``.

    .venv/bin/python bench/gateway.py --quick    # ~2 min, one JSON object on stdout
    .venv/bin/python bench/gateway.py            # the figures of docs/benchmarks/gateway.md

Starts local Kafka and Redis in a temporary home (unless SWITCHYARD_KAFKA/REDIS are set),
one fake vLLM server, its worker, the router (``round-robin``, the default predictor) and
``switchyard gateway``; then the same ``/v1/completions`` request (``max_tokens`` 16) is
sent by ``hey`` (Debian's HTTP load generator, installed when missing) ``--requests`` times
with ``--concurrency`` clients, first to the fake vLLM server directly, then to the
gateway, alternating ``--rounds`` times. Figures: per-request latency p50/p90/p99 of each
target (``hey -o csv``), and ``added_ms`` = gateway − direct at each percentile, with the
load average beside them. Everything it started is stopped by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from switchyard import services  # noqa: E402
from switchyard.processes import ProcessGroup  # noqa: E402

MODEL = "qwen2.5-7b-instruct"  # a model the default predictor knows


def hey(url: str, body: dict[str, object], n: int, c: int, key: str) -> list[float]:
    """Per-request latencies (ms) of ``n`` POSTs with ``c`` concurrent clients."""
    binary = services.ensure_debian_tool("hey", "hey")
    proc = subprocess.run(
        [binary, "-n", str(n), "-c", str(c), "-m", "POST", "-T", "application/json",
         "-H", f"Authorization: Bearer {key}", "-d", json.dumps(body), "-o", "csv", url],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"hey failed: {proc.stderr[-2000:]}")
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    bad = [r for r in rows if r.get("status-code") != "200"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(rows)} requests to {url} failed: {bad[0]}")
    return [float(r["response-time"]) * 1000.0 for r in rows]


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {f"p{q}": round(float(np.percentile(a, q)), 2) for q in (50, 90, 99)}


async def alive(redis_url: str, ns: str, instance: str) -> None:
    from state import StateStore

    store = await StateStore.connect(redis_url, namespace=ns)
    try:
        async with asyncio.timeout(120):
            while not (await store.snapshots([instance], time.time()))[instance].alive:
                await asyncio.sleep(0.2)
    finally:
        await store.close()


def run(args: argparse.Namespace, bootstrap: str, redis_url: str, home: Path) -> dict[str, object]:
    rid = "g" + uuid.uuid4().hex[:6]
    port, gw_port = services.free_port(), services.free_port()
    spec = {
        "models": [{"name": MODEL, "profile": "llama-2-7b-hf@h100", "input_usd_per_token": 2e-7,
                    "output_usd_per_token": 2e-7, "max_concurrency": 256}],  # fmt: skip
        "instances": [{"id": f"{rid}-0", "model": MODEL, "endpoint": f"http://127.0.0.1:{port}"}],
        "tenants": [{"tenant": "default", "budget_usd": 1000.0}],
    }
    cluster = home / f"cluster-{rid}.json"
    cluster.write_text(json.dumps(spec))
    ns = f"b{rid}"
    env = dict(os.environ, SWITCHYARD_KAFKA=bootstrap, SWITCHYARD_REDIS=redis_url,
               SWITCHYARD_NAMESPACE=ns, SWITCHYARD_CLUSTER=str(cluster))  # fmt: skip
    procs = ProcessGroup(home / f"logs-{rid}", env=env)
    try:
        procs.switchyard("vllm", "fake-vllm", "--instance", f"{rid}-0", "--port", str(port),
                         "--time-scale", str(args.time_scale))  # fmt: skip
        router = procs.switchyard("router", "router", "--policy", "round-robin", "--from", "latest",
                                  "--app-id", f"router-{rid}", "--window-ms", str(args.window_ms))  # fmt: skip
        procs.wait_for_line(router, "assigned queries partitions", 300)
        procs.switchyard("worker", "worker", "--instance", f"{rid}-0")
        asyncio.run(alive(redis_url, ns, f"{rid}-0"))
        gw = procs.switchyard("gateway", "gateway", "--port", str(gw_port), "--id", rid,
                              "--anonymous-tenant", "default")  # fmt: skip
        procs.wait_for_line(gw, "serving the OpenAI API", 60)
        body = {"model": MODEL, "prompt": "Describe a rail switchyard in one sentence.", "max_tokens": 16}
        direct_url = f"http://127.0.0.1:{port}/v1/completions"
        gateway_url = f"http://127.0.0.1:{gw_port}/v1/completions"
        hey(gateway_url, body, 20, 4, "x")  # warm-up: topics, connections, first windows
        direct: list[float] = []
        via: list[float] = []
        for _ in range(args.rounds):
            direct += hey(direct_url, body, args.requests, args.concurrency, "x")
            via += hey(gateway_url, body, args.requests, args.concurrency, "x")
        d, g = percentiles(direct), percentiles(via)
        return {
            "requests_per_target": len(direct),
            "concurrency": args.concurrency,
            "window_ms": args.window_ms,
            "time_scale": args.time_scale,
            "direct_ms": d,
            "gateway_ms": g,
            "added_ms": {k: round(g[k] - d[k], 2) for k in d},
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        procs.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=400, help="per target per round")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window-ms", type=float, default=20.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.rounds = 100, 1
    started: list[str] = []
    home = Path(tempfile.mkdtemp(prefix="switchyard-bench-gateway-"))
    try:
        bootstrap = os.environ.get("SWITCHYARD_KAFKA")
        redis_url = os.environ.get("SWITCHYARD_REDIS")
        if not redis_url:
            redis_url = services.redis_up(home=home, port=services.free_port()).address
            started.append("redis")
        if not bootstrap:
            bootstrap = services.kafka_up(home=home, port=services.free_port()).address
            started.append("kafka")
        result = run(args, bootstrap, redis_url, home)
    finally:
        if started:
            services.down(home, names=started)
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
