"""Real vLLM servers on loopback, one per cluster instance: start, wait for ``/health``, stop.

Each server is ``vllm serve`` from the engine's own venv (``switchyard.vllm_env``) over a
model directory of random weights (``switchyard.vllm_model``, ``--load-format dummy``), with
the instance's model settings from the cluster config:

    --max-model-len          ModelSpec.max_model_len
    --max-num-seqs           scheduler.max_num_seqs
    --max-num-batched-tokens scheduler.max_num_batched_tokens
    --block-size             scheduler.block_size_tokens (the KV block the router's prefix
                             and KV models count in: vLLM's own default differs by device)
    VLLM_CPU_KVCACHE_SPACE   scheduler.kv_blocks × block_size_tokens × KV bytes per token,
                             rounded up to whole GiB (the CPU build takes whole GiB)
    prefix caching           scheduler.prefix_caching
    --served-model-name      ModelSpec.name

and ``--enforce-eager`` (torch.compile's cache does not reload in this build, so every start
would recompile: 45-105 s instead of ~35 s), and ``--enable-prompt-tokens-details`` (each
usage chunk then says how many prompt tokens the prefix cache served, which the worker bills at
the model's cached-input price).

CPU binding: left alone, vLLM's CPU build binds every server's OpenMP threads by NUMA node
(``VLLM_CPU_OMP_THREADS_BIND=auto``), so two servers on one node are pinned to the *same* cores
and each one's steps slow down whenever the other computes; no per-instance model can predict
that. When several servers start together, each gets its own share of this process's CPUs
instead (``cpu_binds``: 2 servers on 2 cores, one core each, like the 1-thread profile of the
shipped model); a ``VLLM_CPU_OMP_THREADS_BIND`` in the environment is respected as given. A server runs in its own process group (the API
server, its engine core and worker); it is recorded like Kafka and Redis
(``<state dir>/services/vllm-<instance>.json``) and ``down`` stops exactly that group.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from schemas.cluster import ClusterConfig, InstanceSpec, ModelSpec
from switchyard import services, vllm_env, vllm_model
from wiring.paths import REPO_ROOT, state_dir

DEFAULT_CLUSTER = REPO_ROOT / "configs" / "clusters" / "real-vllm-cpu.yaml"
RECORD_PREFIX = "vllm-"
HEALTH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ServerSettings:
    """The engine arguments of one instance, read from its model's spec."""

    instance: str
    model: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_gib: int
    prefix_caching: bool
    block_size_tokens: int

    @classmethod
    def of(
        cls, inst: InstanceSpec, spec: ModelSpec, shape: vllm_model.ModelShape
    ) -> ServerSettings:
        if spec.max_model_len is None:
            raise services.ServiceError(
                f"model {spec.name}: a real vLLM server needs max_model_len in the cluster config"
            )
        sch = spec.scheduler
        kv_bytes = sch.kv_blocks * sch.block_size_tokens * shape.kv_bytes_per_token()
        return cls(
            instance=inst.id,
            model=spec.name,
            max_model_len=spec.max_model_len,
            max_num_seqs=sch.max_num_seqs,
            max_num_batched_tokens=sch.max_num_batched_tokens,
            kv_cache_gib=max(1, math.ceil(kv_bytes / 2**30)),
            prefix_caching=sch.prefix_caching,
            block_size_tokens=sch.block_size_tokens,
        )

    def args(self, model_dir: Path, port: int) -> list[str]:
        return [
            "serve", str(model_dir),
            "--served-model-name", self.model,
            "--load-format", "dummy",
            "--dtype", "bfloat16",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--block-size", str(self.block_size_tokens),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--uvicorn-log-level", "warning",
        ]  # fmt: skip


def local_instances(cluster: ClusterConfig, count: int | None = None) -> list[InstanceSpec]:
    """The first ``count`` (all by default) instances of local models."""
    local = {m.name for m in cluster.models if m.kind == "local"}
    chosen = [i for i in cluster.instances if i.model in local]
    if count is not None:
        if count > len(chosen):
            raise services.ServiceError(
                f"--vllm {count}: the cluster config has only {len(chosen)} local instance(s)"
            )
        chosen = chosen[:count]
    return chosen


def cpu_binds(n_servers: int, cpus: list[int]) -> list[str | None]:
    """One ``VLLM_CPU_OMP_THREADS_BIND`` per server: ``cpus`` split into ``n_servers`` contiguous
    shares of equal size (at least one CPU; shares wrap around when servers outnumber CPUs).
    ``None`` (vLLM's own choice) for a lone server or when the user set the variable."""
    if n_servers < 2 or not cpus or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return [None] * n_servers
    ordered = sorted(cpus)
    share = max(1, len(ordered) // n_servers)
    binds: list[str | None] = []
    for i in range(n_servers):
        start = (i * share) % len(ordered)
        binds.append(",".join(str(c) for c in ordered[start : start + share]))
    return binds


def _port_of(inst: InstanceSpec) -> int | None:
    if not inst.endpoint:
        return None
    tail = inst.endpoint.rstrip("/").rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def vllm_up(
    cluster: ClusterConfig,
    count: int | None = None,
    home: Path | None = None,
    free_ports: bool = False,
    timeout_s: float = HEALTH_TIMEOUT_S,
    shape: vllm_model.ModelShape | None = None,
) -> list[services.ServiceRecord]:
    """Start a server per local instance (all at once), return once every ``/health`` is 200.

    Ports come from the instances' endpoints (``free_ports``: any free port instead). A server
    already recorded and running is reused. On any failure every server started here is
    stopped and the error carries the failing server's log tail.
    """
    env = vllm_env.install()
    shape = shape or vllm_model.ModelShape()
    model_dir = vllm_model.make_model_dir(shape)
    records = services.load_records(home)
    specs = {m.name: m for m in cluster.models}
    out: list[services.ServiceRecord] = []
    started: list[services.ServiceRecord] = []
    chosen = local_instances(cluster, count)
    binds = cpu_binds(len(chosen), sorted(os.sched_getaffinity(0)))
    try:
        for inst, bind in zip(chosen, binds, strict=True):
            name = RECORD_PREFIX + inst.id
            rec = records.get(name)
            if rec is not None and rec.alive():
                out.append(rec)
                continue
            settings = ServerSettings.of(inst, specs[inst.model], shape)
            wanted = None if free_ports else _port_of(inst)
            port = services._pick_port(wanted, 0) if wanted else services.free_port()
            rec = _start(env, settings, model_dir, port, home, cpu_bind=bind)
            started.append(rec)
            out.append(rec)
        deadline = time.monotonic() + timeout_s
        for rec in started:
            _wait_healthy(rec, deadline)
            rec.extra["ready_s"] = round(time.time() - rec.started_at, 1)
            services._save(rec, home)
    except BaseException:
        for rec in started:
            stop_group(rec, home)
        raise
    return out


def _start(
    env: vllm_env.VllmEnv,
    settings: ServerSettings,
    model_dir: Path,
    port: int,
    home: Path | None,
    cpu_bind: str | None = None,
) -> services.ServiceRecord:
    run = (home or state_dir()) / f"vllm-{settings.instance}"
    run.mkdir(parents=True, exist_ok=True)
    log = run / "server.log"
    child_env = vllm_env.engine_env()
    child_env.update(
        VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib),
        VLLM_CACHE_ROOT=str(run / "cache"),
    )
    if cpu_bind is not None:
        child_env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    cmd = [str(env.vllm), *settings.args(model_dir, port)]
    with open(log, "wb") as out:
        child = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
    autogroup_nice = vllm_env.prioritise_session(child.pid)
    rec = services.ServiceRecord(
        name=RECORD_PREFIX + settings.instance,
        pid=child.pid,
        address=f"http://127.0.0.1:{port}",
        version=env.version,
        marker=f"--port {port}",
        log=str(log),
        data_dir=str(run),
        started_at=time.time(),
        extra={
            "process_group": True,
            "instance": settings.instance,
            "model": settings.model,
            "model_dir": str(model_dir),
            "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "kv_cache_gib": settings.kv_cache_gib,
            "prefix_caching": settings.prefix_caching,
            "cpu_bind": cpu_bind or child_env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "autogroup_nice": autogroup_nice,
        },
    )
    services._save(rec, home)
    return rec


def healthy(address: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{address}/health", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_healthy(rec: services.ServiceRecord, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not _pid_alive(rec.pid):
            raise services.ServiceError(
                f"vLLM server {rec.name} ({rec.address}) exited before /health answered; "
                f"log {rec.log}:\n{_tail(rec.log)}"
            )
        if healthy(rec.address):
            return
        time.sleep(1.0)
    raise services.ServiceError(
        f"vLLM server {rec.name} ({rec.address}) gave no /health 200 within the timeout; "
        f"log {rec.log}:\n{_tail(rec.log)}"
    )


def _pid_alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (another `up` started it)
        done = 0
    return done == 0 and Path(f"/proc/{pid}").exists()


def _tail(log: str, n_chars: int = 3000) -> str:
    try:
        return Path(log).read_text(errors="replace")[-n_chars:]
    except OSError:
        return ""


def stop_group(
    rec: services.ServiceRecord, home: Path | None = None, grace_s: float = 20.0
) -> None:
    """SIGTERM the server's process group (its pid is the group id), SIGKILL after ``grace_s``."""
    if rec.alive():
        _signal_group(rec.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(rec.pid):
            services._reap(rec.pid)
            time.sleep(0.2)
        if _group_alive(rec.pid):
            _signal_group(rec.pid, signal.SIGKILL)
    services._reap(rec.pid)
    services._records_dir(home).joinpath(f"{rec.name}.json").unlink(missing_ok=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie leader still counts for killpg; the group is gone once only it is left
    services._reap(pgid)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def vllm_down(home: Path | None = None) -> list[str]:
    """Stop every recorded vLLM server (their process groups only)."""
    stopped = []
    for name, rec in services.load_records(home).items():
        if name.startswith(RECORD_PREFIX):
            stop_group(rec, home)
            stopped.append(name)
    return stopped


def with_endpoints(cluster: ClusterConfig, records: list[services.ServiceRecord]) -> ClusterConfig:
    """The cluster config with each started instance's endpoint set to its server's address."""
    by_instance = {str(r.extra.get("instance")): r.address for r in records}
    instances = [
        i.model_copy(update={"endpoint": by_instance[i.id]}) if i.id in by_instance else i
        for i in cluster.instances
    ]
    return cluster.model_copy(update={"instances": instances})
