"""Run a command with the local Kafka and Redis up; stop afterwards only what this run started.

``python -m switchyard.testrun -- pytest …`` — used by ``make test``. The command sees
``SWITCHYARD_KAFKA`` and ``SWITCHYARD_REDIS``; its exit code is returned.

``python -m switchyard.testrun --vllm-last -- pytest …`` — used by ``make test``: the real vLLM
engine's venv and model directory are prepared in the background while ``pytest … -m "not
vllm"`` runs, then ``pytest … -m vllm --timeout 900`` runs the real-vLLM tests last (the venv
is cached under ``~/.cache/switchyard``, so only a fresh machine pays the ~2-4 min install,
and it overlaps the main suite). ``SWITCHYARD_VLLM_TESTS=0`` skips that second run.

``python -m switchyard.testrun --clusters -- pytest …`` — used by ``make test-cluster``:
a 3-broker KRaft Kafka and a 3-primary Redis Cluster (one replica each) instead, with
``SWITCHYARD_KAFKA_REPLICATION_FACTOR=3`` and ``SWITCHYARD_CLUSTER_TESTS=1``; all stopped after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from switchyard import services
from wiring.paths import state_dir


def main(argv: list[str]) -> int:
    vllm_last = False
    if "--" in argv:
        if "--clusters" in argv[: argv.index("--")]:
            return run_on_clusters(argv[argv.index("--") + 1 :])
        vllm_last = "--vllm-last" in argv[: argv.index("--")]
        argv = argv[argv.index("--") + 1 :]
    if not argv:
        print("usage: python -m switchyard.testrun -- COMMAND …", file=sys.stderr)
        return 2
    before = {name for name, rec in services.load_records().items() if rec.alive()}
    t0 = time.monotonic()
    try:
        redis = services.redis_up(fresh="redis" not in before)  # a test run starts empty
        kafka = services.kafka_up()
    except services.ServiceError as exc:
        print(f"error: could not start services: {exc}", file=sys.stderr)
        services.down(names=[n for n in ("kafka", "redis") if n not in before])
        return 1
    print(
        f"services: Kafka {kafka.version} at {kafka.address} (pid {kafka.pid}), "
        f"Redis {redis.version} at {redis.address} (pid {redis.pid}), up in {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    env = dict(os.environ, SWITCHYARD_KAFKA=kafka.address, SWITCHYARD_REDIS=redis.address)
    try:
        if vllm_last and os.environ.get("SWITCHYARD_VLLM_TESTS", "1") != "0":
            return _main_then_vllm(argv, env)
        return subprocess.call(argv, env=env)
    finally:
        started = [n for n in ("kafka", "redis") if n not in before]
        services.down(names=started, purge=True)
        print(
            f"services: stopped {', '.join(started) or 'nothing'} (started by this run)", flush=True
        )


def _main_then_vllm(argv: list[str], env: dict[str, str]) -> int:
    """The suite without the ``vllm`` marker while the engine is prepared, then the ``vllm`` tests."""
    prepared = _in_background(_prepare_vllm)
    t0 = time.monotonic()
    rc_main = subprocess.call(with_marker(argv, "not vllm"), env=env)
    print(f"testrun: main suite took {time.monotonic() - t0:.0f} s", flush=True)
    error = prepared()
    if error is not None:
        print(f"error: the real vLLM engine could not be prepared: {error}", file=sys.stderr)
        return rc_main or 1
    t1 = time.monotonic()
    rc_vllm = subprocess.call([*with_marker(argv, "vllm"), "--timeout", "900"], env=env)
    print(f"testrun: vllm tests took {time.monotonic() - t1:.0f} s", flush=True)
    rc_vllm = 0 if rc_vllm == 5 else rc_vllm  # 5: a path selection with no vllm test in it
    return rc_main or rc_vllm


def with_marker(argv: list[str], expr: str) -> list[str]:
    """``argv`` with pytest's ``-m`` narrowed by ``expr``: a ``-m E`` already there becomes
    ``-m "(E) and (expr)"`` (pytest keeps only the last ``-m``, so appending would drop E)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "-m" and i + 1 < len(out):
            out[i + 1] = f"({out[i + 1]}) and ({expr})"
            return out
        if arg.startswith("-m") and len(arg) > 2:
            out[i] = f"-m({arg[2:]}) and ({expr})"
            return out
    return [*out, "-m", expr]


def _prepare_vllm() -> str:
    from switchyard import vllm_env, vllm_model

    log = state_dir() / "vllm-install.log"
    env = vllm_env.install(log=log)
    model_dir = vllm_model.make_model_dir()
    how = f"installed in {env.install_s:.0f} s" if env.install_s else "reused"
    return f"vllm {env.version} at {env.root} ({how}, {env.size_bytes / 2**30:.2f} GiB); model {model_dir}"


def _in_background(job: Callable[[], str]) -> Callable[[], str | None]:
    """Run ``job`` in a thread; the returned wait gives None on success, else the error."""
    outcome: list[str | None] = []

    def run() -> None:
        try:
            print(f"testrun: {job()}", flush=True)
            outcome.append(None)
        except Exception as exc:  # reported when the vllm tests would start
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, name="prepare-vllm", daemon=True)
    thread.start()

    def wait() -> str | None:
        thread.join()
        return outcome[0] if outcome else "the preparation thread ended without a result"

    return wait


def run_on_clusters(argv: list[str]) -> int:
    from switchyard import clusters

    if not argv:
        print("usage: python -m switchyard.testrun --clusters -- COMMAND …", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        redis = clusters.redis_cluster_up(3, replicas=1)
        kafka = clusters.kafka_cluster_up(3)
    except services.ServiceError as exc:
        print(f"error: could not start the clusters: {exc}", file=sys.stderr)
        clusters.down()
        return 1
    env = dict(os.environ, SWITCHYARD_CLUSTER_TESTS="1")
    for line in clusters.env_lines():
        key, _, value = line.partition("=")
        env[key] = value
    print(
        f"clusters: Kafka {kafka[0].version} x{len(kafka)} at {env['SWITCHYARD_KAFKA']}, "
        f"Redis Cluster {redis[0].version} x{len(redis)} at {env['SWITCHYARD_REDIS']}, "
        f"up in {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    try:
        return subprocess.call(argv, env=env)
    finally:
        stopped = clusters.down()
        print(f"clusters: stopped {', '.join(stopped)}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
