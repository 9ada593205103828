"""Run a command with the local Kafka and Redis up; stop afterwards only what this run started.

``python -m switchyard.testrun -- pytest …`` — used by ``make test``. The command sees
``SWITCHYARD_KAFKA`` and ``SWITCHYARD_REDIS``; its exit code is returned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from switchyard import services


def main(argv: list[str]) -> int:
    if "--" in argv:
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
