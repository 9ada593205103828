"""Session fixtures: a real Kafka bootstrap address and a real Redis URL.

Order: ``SWITCHYARD_KAFKA`` / ``SWITCHYARD_REDIS`` when set (``make test`` starts the local
services and sets them); else testcontainers when a Docker engine answers; else the local
services are started here (Maven Central jars + Debian redis-server) and stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from wiring.paths import shared_dir


def _docker_answers() -> bool:
    if shutil.which("docker") is None and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def services_home() -> Iterator[Path]:
    home = Path(tempfile.mkdtemp(prefix="switchyard-test-"))
    yield home
    from switchyard import services

    services.down(home)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> Iterator[str]:
    env = os.environ.get("SWITCHYARD_KAFKA")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer("apache/kafka:3.9.1").with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from switchyard import services

    home = request.getfixturevalue("services_home")
    yield services.kafka_up(home=home, port=services.free_port()).address


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    env = os.environ.get("SWITCHYARD_REDIS")
    if env:
        yield env
        return
    if _docker_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7") as r:
            yield f"redis://{r.get_container_host_ip()}:{r.get_exposed_port(6379)}/0"
        return
    from switchyard import services

    home = request.getfixturevalue("services_home")
    yield services.redis_up(home=home, port=services.free_port()).address


@pytest.fixture(scope="session")
def shared_available() -> bool:
    return (shared_dir() / "data").is_dir()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if (shared_dir() / "data").is_dir():
        return
    skip = pytest.mark.skip(reason="../shared/data is absent")
    for item in items:
        if "shared_data" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS threads busy-wait: on a loaded 2-core machine these small fits run ~10x
    slower with them. One thread for this module, restored afterwards."""
    import ctypes
    import glob

    import numpy as np

    libs = glob.glob(str(Path(np.__file__).parent.parent / "numpy.libs" / "libscipy_openblas*.so"))
    saved = []
    for lib in libs:
        dll = ctypes.CDLL(lib)
        get = getattr(dll, "scipy_openblas_get_num_threads64_", None)
        put = getattr(dll, "scipy_openblas_set_num_threads64_", None)
        if get is not None and put is not None:
            saved.append((int(get()), put))
            put(1)
    yield
    for n, put in saved:
        put(n)


@pytest.fixture(autouse=True)
def _dump_asyncio_tasks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test about to hit pytest-timeout prints every pending asyncio task's stack to
    stderr first: the timeout's own dump shows only threads, and a hung ``await`` sits in
    a task while the loop idles in ``select`` (the worker-test hangs of two CI runs)."""
    import asyncio
    import sys
    import threading

    marker = request.node.get_closest_marker("timeout")
    timeout_s = float(marker.args[0]) if marker and marker.args else request.config.getoption(
        "timeout", None
    ) or 0.0
    if timeout_s <= 15:
        yield
        return

    def dump() -> None:
        tasks = [t for t in list(getattr(asyncio.tasks, "_all_tasks", ())) if not t.done()]
        print(f"\n+++ {len(tasks)} pending asyncio tasks {timeout_s - 10:g} s in +++", file=sys.stderr)
        for task in tasks:
            print(f"--- {task!r}", file=sys.stderr)
            task.print_stack(limit=30, file=sys.stderr)
        sys.stderr.flush()

    timer = threading.Timer(timeout_s - 10, dump)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
