"""docker-compose.yml, Prometheus and Grafana files: checked by real tools and against the code.

- Debian's ``docker-compose config`` (installed here when missing) validates the file,
  with and without the ``vllm`` profile;
- every instance of the shipped demo cluster has a fake vLLM server and a worker pointed
  at it; every command parses with the real ``switchyard`` CLI; environment names are the
  ones the code reads; Kafka and Redis ports are the local launcher's;
- Prometheus scrapes each component's metrics port;
- every metric a Grafana panel queries is one the code exports.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from schemas import ClusterConfig
from wiring.paths import DEFAULT_CLUSTER, REPO_ROOT

COMPOSE = REPO_ROOT / "docker-compose.yml"
PROMETHEUS = REPO_ROOT / "deploy" / "prometheus.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "switchyard.json"


def docker_compose() -> str:
    from switchyard.services import ServiceError, ensure_debian_tool

    try:
        return ensure_debian_tool("docker-compose", "docker-compose")
    except ServiceError as exc:
        pytest.skip(str(exc))


def resolved(*profile: str) -> dict[str, Any]:
    """The file as ``docker-compose config`` resolves it (anchors, defaults, profiles)."""
    args = [docker_compose(), "-f", str(COMPOSE)]
    args += [a for p in profile for a in ("--profile", p)]
    proc = subprocess.run([*args, "config"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = yaml.safe_load(proc.stdout)
    return data


def test_compose_file_is_valid_with_and_without_the_vllm_profile() -> None:
    plain, gpu = resolved(), resolved("vllm")
    assert plain["services"]["vllm"]["profiles"] == ["vllm"] and "vllm" in gpu["services"]
    started = {n for n, s in plain["services"].items() if not s.get("profiles")}
    assert "vllm" not in started and {"router", "gateway", "prometheus", "grafana"} <= started
    assert "name" not in yaml.safe_load(COMPOSE.read_text())  # compose v1 refuses it


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return cmd if isinstance(cmd, list) else cmd.split()


def _opt(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_one_fake_vllm_and_one_worker_per_instance_and_commands_parse() -> None:
    from typer.main import get_command

    from switchyard.cli import app

    services = resolved()["services"]
    env = services["router"]["environment"]
    cluster = ClusterConfig.from_file(REPO_ROOT / env["SWITCHYARD_CLUSTER"].removeprefix("/app/"))
    assert Path(REPO_ROOT / env["SWITCHYARD_CLUSTER"].removeprefix("/app/")) == DEFAULT_CLUSTER
    for inst in cluster.instances:
        fake = _command(services[f"vllm-{inst.id}"])
        worker = _command(services[f"worker-{inst.id}"])
        assert fake[:2] == ["switchyard", "fake-vllm"] and _opt(fake, "--instance") == inst.id
        assert worker[:2] == ["switchyard", "worker"] and _opt(worker, "--instance") == inst.id
        endpoint = urlsplit(_opt(worker, "--endpoint"))
        assert endpoint.hostname == f"vllm-{inst.id}" and endpoint.port == int(_opt(fake, "--port"))
    workers = [n for n in services if n.startswith("worker-")]
    assert len(workers) == len(cluster.instances)
    cli = get_command(app)
    for name, svc in services.items():
        cmd = _command(svc)
        if cmd[:1] != ["switchyard"]:
            continue
        sub = cli.get_command(cli.make_context("switchyard", [cmd[1]]), cmd[1])  # type: ignore[attr-defined]
        assert sub is not None, f"{name}: no command {cmd[1]!r}"
        sub.make_context(cmd[1], cmd[2:])  # raises on an unknown option or a bad value


def test_environment_and_ports_are_the_local_launchers() -> None:
    from wiring.settings import _ENV, DEFAULT_KAFKA, DEFAULT_REDIS

    services = resolved()["services"]
    known = set(_ENV.values()) | {"SWITCHYARD_CLUSTER", "SWITCHYARD_HOME"}
    for name, svc in services.items():
        if _command(svc)[:1] == ["switchyard"]:
            assert set(svc["environment"]) <= known, name
            assert svc["environment"]["SWITCHYARD_KAFKA"] == "kafka:19092"
    ports = {name: [str(p.get("published")) for p in svc.get("ports", [])] for name, svc in services.items()}
    assert DEFAULT_KAFKA.rsplit(":", 1)[1] in ports["kafka"]
    assert str(urlsplit(DEFAULT_REDIS).port) in ports["redis"]


def test_prometheus_scrapes_every_component() -> None:
    services = resolved()["services"]
    prom = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, svc in services.items():
        cmd = _command(svc)
        if cmd[:1] != ["switchyard"] or svc.get("profiles"):
            continue
        port = _opt(cmd, "--metrics-port") if "--metrics-port" in cmd else _opt(cmd, "--port")
        assert f"{name}:{port}" in targets, f"{name} is not scraped"
        if "--metrics-port" in cmd:
            assert _opt(cmd, "--metrics-host") == "0.0.0.0", f"{name}: /metrics only on loopback"
    hosts = {t.split(":")[0] for t in targets}
    assert hosts <= set(services), f"scrape targets without a service: {hosts - set(services)}"


_PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "le", "avg", "max", "min",
                 "without", "on", "ignoring", "count", "irate"}  # fmt: skip


def exported_metric_names() -> set[str]:
    """Every sample name the router, worker, gateway and fake vLLM registries expose."""
    from gateway.metrics import GatewayMetrics
    from streams.metrics import RouterMetrics
    from workers.fake_vllm import build_server
    from workers.metrics import WorkerMetrics

    names: set[str] = set()
    for registry in (RouterMetrics().registry, WorkerMetrics("i", "m").registry,
                     GatewayMetrics().registry, build_server(profile="llama-2-7b-hf@h100").registry):  # fmt: skip
        for family in registry.collect():
            names.add(family.name)
            names |= {f"{family.name}{s}" for s in ("_total", "_bucket", "_count", "_sum")}
    return names


def test_dashboard_queries_name_metrics_the_code_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 6 and exprs
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("routed", "decide", "slo", "budget", "load", "dead letters"):
        assert topic in titles
    exported = exported_metric_names()
    for expr in exprs:
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\b(by|without)\s*\([^)]*\)", " ", expr)
        names = {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if w not in _PROMQL_WORDS}
        names = {n for n in names if not re.fullmatch(r"\d.*", n)}
        assert names, expr
        missing = names - exported
        assert not missing, f"{expr}: {sorted(missing)} is not exported by the code"


def test_the_image_holds_every_package_and_the_configs() -> None:
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\S+) ", (REPO_ROOT / "Dockerfile").read_text(), re.M))
    for pattern in include:
        assert pattern.rstrip("*") in copied, f"Dockerfile does not copy {pattern.rstrip('*')}/"
    assert {"configs", "data"} <= copied
