"""Run a command with the local Kafka and Redis up; stop afterwards only what this run started.

``python -m switchyard.testrun -- pytest …`` — used by ``make test``. The command sees
``SWITCHYARD_KAFKA`` and ``SWITCHYARD_REDIS``; its exit code is returned.

``python -m switchyard.testrun --clusters -- pytest …`` — used by ``make test-cluster``:
a 3-broker KRaft Kafka and a 3-primary Redis Cluster (one replica each) instead, with
``SWITCHYARD_KAFKA_REPLICATION_FACTOR=3`` and ``SWITCHYARD_CLUSTER_TESTS=1``; all stopped after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from switchyard import services


def main(argv: list[str]) -> int:
    if "--" in argv:
        if "--clusters" in argv[: argv.index("--")]:
            return run_on_clusters(argv[argv.index("--") + 1 :])
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
        return subprocess.call(argv, env=env)
    finally:
        started = [n for n in ("kafka", "redis") if n not in before]
        services.down(names=started, purge=True)
        print(
            f"services: stopped {', '.join(started) or 'nothing'} (started by this run)", flush=True
        )


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
