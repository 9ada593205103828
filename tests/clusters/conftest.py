"""The cluster suite: a local 3-broker KRaft Kafka and a 3-primary Redis Cluster (1 replica
each), started once per session under a temporary home and stopped at the end by pid.

Run by ``make test-cluster`` (which sets ``SWITCHYARD_CLUSTER_TESTS=1``; ``.ci/run`` runs it
after ``make test``); the plain ``make test`` skips this folder to stay within its time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from switchyard import clusters
from switchyard.services import ServiceRecord
from wiring.paths import state_dir

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SWITCHYARD_CLUSTER_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="cluster suite: run with `make test-cluster`")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@dataclass
class Clusters:
    home: Path
    kafka: list[ServiceRecord]
    redis: list[ServiceRecord]

    @property
    def bootstrap(self) -> str:
        return ",".join(r.address for r in self.kafka)

    @property
    def redis_url(self) -> str:
        return clusters.redis_cluster_url(self.redis)


@pytest.fixture(scope="session")
def cluster_home() -> Iterator[Path]:
    """``make test-cluster``'s home when it started the clusters, else a temporary one
    whose nodes are stopped at the end."""
    if clusters.kafka_nodes() or clusters.redis_nodes():
        yield state_dir()
        return
    home = Path(tempfile.mkdtemp(prefix="switchyard-clusters-"))
    try:
        yield home
    finally:
        clusters.down(home)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster(cluster_home: Path) -> list[ServiceRecord]:
    """3 primaries, one replica each."""
    return clusters.redis_nodes(cluster_home) or clusters.redis_cluster_up(
        3, replicas=1, home=cluster_home
    )


@pytest.fixture(scope="session")
def kafka_cluster(cluster_home: Path) -> list[ServiceRecord]:
    """3 combined broker+controller nodes."""
    return clusters.kafka_nodes(cluster_home) or clusters.kafka_cluster_up(3, home=cluster_home)


@pytest.fixture
def local_redis(cluster_home: Path, redis_cluster: list[ServiceRecord]) -> Clusters:
    return Clusters(cluster_home, [], redis_cluster)


@pytest.fixture
def local_kafka(cluster_home: Path, kafka_cluster: list[ServiceRecord]) -> Clusters:
    return Clusters(cluster_home, kafka_cluster, [])
