"""A running service for the front-door tests: fake vLLM servers, the router, the workers.

Every piece is the real command (``switchyard fake-vllm``, ``router``, ``worker``,
``gateway``) in its own process over the real Kafka and Redis of the test session; the
router runs a registered policy with the default predictor (trained once per
``$SWITCHYARD_HOME`` and cached), so model constraints go through ``make_router``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard import services
from switchyard.processes import Child, ProcessGroup

SMALL, LARGE = "qwen2.5-7b-instruct", "llama3-chatqa-1.5-70b"  # models the default predictor knows


@dataclass
class Stack:
    rid: str
    procs: ProcessGroup
    cluster_file: Path
    spec: dict[str, Any]
    env: dict[str, str]
    gateway_url: str | None = None

    def run(self, name: str, *args: str) -> Child:
        return self.procs.switchyard(name, *args)


def cluster_spec(rid: str, ports: dict[str, int], tenants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "models": [
            {"name": SMALL, "profile": "llama-2-7b-hf@h100", "input_usd_per_token": 1e-7,
             "output_usd_per_token": 2e-7, "max_concurrency": 16},
            {"name": LARGE, "profile": "llama-2-70b-hf@h100", "input_usd_per_token": 9e-7,
             "output_usd_per_token": 9e-7, "max_concurrency": 16},
        ],  # fmt: skip
        "instances": [
            {"id": f"{rid}-s", "model": SMALL, "endpoint": f"http://127.0.0.1:{ports['s']}"},
            {"id": f"{rid}-l", "model": LARGE, "endpoint": f"http://127.0.0.1:{ports['l']}"},
        ],
        "tenants": tenants,
        "model_groups": {"big": [LARGE]},
    }


def http_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


async def wait_alive(redis_url: str, namespace: str, ids: list[str], timeout_s: float = 60) -> None:
    from state import StateStore

    store = await StateStore.connect(redis_url, namespace=namespace)
    try:
        async with asyncio.timeout(timeout_s):
            while not all(v.alive for v in (await store.snapshots(ids, time.time())).values()):
                await asyncio.sleep(0.2)
    finally:
        await store.close()


@contextmanager
def stack(
    tmp: Path,
    kafka: str,
    redis: str,
    *,
    tenants: list[dict[str, Any]] | None = None,
    policy: str = "round-robin",
    time_scale: float = 5.0,
    gateway_args: tuple[str, ...] | None = None,
) -> Iterator[Stack]:
    """Fake vLLM + worker for a small and a large instance, the router, and a gateway."""
    rid = "f" + uuid.uuid4().hex[:6]
    ports = {"s": services.free_port(), "l": services.free_port()}
    spec = cluster_spec(rid, ports, tenants or [{"tenant": "default", "budget_usd": 100.0}])
    cluster_file = tmp / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    env = dict(os.environ, SWITCHYARD_KAFKA=kafka, SWITCHYARD_REDIS=redis,
               SWITCHYARD_NAMESPACE=f"t{rid}", SWITCHYARD_CLUSTER=str(cluster_file))  # fmt: skip
    procs = ProcessGroup(tmp / "logs", env=env)
    st = Stack(rid, procs, cluster_file, spec, env)
    try:
        for inst in spec["instances"]:
            st.run(f"vllm-{inst['id']}", "fake-vllm", "--cluster", str(cluster_file), "--instance",
                   inst["id"], "--port", inst["endpoint"].rsplit(":", 1)[1], "--time-scale", str(time_scale),
                   "--mean-output-tokens", "16")  # fmt: skip
        for inst in spec["instances"]:
            http_ready(inst["endpoint"] + "/v1/models")
        router = st.run("router", "router", "--policy", policy, "--from", "latest",
                        "--app-id", f"router-{rid}", "--window-ms", "20")  # fmt: skip
        procs.wait_for_line(router, "assigned queries partitions", 240)
        for inst in spec["instances"]:
            st.run(f"worker-{inst['id']}", "worker", "--instance", inst["id"], "--heartbeat-s", "0.5")
        asyncio.run(wait_alive(redis, f"t{rid}", [i["id"] for i in spec["instances"]]))
        if gateway_args is not None:
            port = services.free_port()
            gw = st.run("gateway", "gateway", "--port", str(port), "--id", rid, *gateway_args)
            procs.wait_for_line(gw, "serving the OpenAI API", 60)
            st.gateway_url = f"http://127.0.0.1:{port}"
        yield st
    finally:
        procs.stop_all()
