"""Workers read routed queries compressed with every Kafka codec by real producers (the Kafka
console producer, kcat); a batch they cannot decode is dead-lettered (stage ``decode``) and
the worker answers what follows it (issue 16)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import aiokafka.codec
import pytest

from schemas import DeadLetter
from state import period_id
from tests.real_producers import CODECS, console_produce, kcat_produce
from tests.workers.test_worker import _cluster, _read_topic, _routed, running
from wiring import kafka_admin, topics
from workers.backends.sim import SimBackend
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration


def _lines(iid: str, tag: str, n: int) -> list[tuple[str, bytes]]:
    period = period_id(time.time(), 3600)
    out = []
    for i in range(n):
        rq = _routed(f"{iid}-{tag}-{i}", iid, period, max_tokens=4)
        out.append((rq.query.id, rq.model_dump_json().encode()))
    return out


def sim_worker(iid: str, rig: dict[str, Any]) -> Worker:
    """A worker over the simulated engine (fast) for one instance of ``_cluster``."""
    cluster = _cluster(iid, max_concurrency=8)
    backend = SimBackend(cluster.model("tiny"), instance_id=iid, time_scale=20.0)
    return Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.2, report_timings=False),
        cluster,
        backend,
        rig["settings"],
        rig["state"],
    )


async def test_worker_answers_routed_queries_of_every_codec(
    env: dict[str, Any],
    kafka_bootstrap: str,
) -> None:
    iid = "codec-" + uuid.uuid4().hex[:8]
    topic = topics.route(iid)
    await kafka_admin.ensure_topics({"bootstrap_servers": kafka_bootstrap}, [topic])
    sent: list[str] = []
    for codec in CODECS:
        for tool, produce in (("console", console_produce), ("kcat", kcat_produce)):
            lines = _lines(iid, f"{tool}-{codec}", 4)
            produce(kafka_bootstrap, topic, [(q.encode(), v) for q, v in lines], codec)
            sent.extend(q for q, _ in lines)
    async with running(sim_worker(iid, env)):
        results = {q: await env["client"].result(q, timeout_s=30) for q in sent}
    assert all(r.error is None and r.output_tokens == 4 for r in results.values()), [
        (q, r.error) for q, r in results.items() if r.error
    ]


async def test_undecodable_batch_is_dead_lettered_and_the_worker_goes_on(
    env: dict[str, Any],
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    iid = "nolz4-" + uuid.uuid4().hex[:8]
    topic = topics.route(iid)
    await kafka_admin.ensure_topics({"bootstrap_servers": kafka_bootstrap}, [topic])
    before, lz4, after = _lines(iid, "a", 3), _lines(iid, "lz4", 5), _lines(iid, "b", 3)
    for lines, codec in ((before, "none"), (lz4, "lz4"), (after, "none")):
        console_produce(kafka_bootstrap, topic, [(q.encode(), v) for q, v in lines], codec)
    monkeypatch.setattr(aiokafka.codec, "cramjam", None)  # this worker has no lz4 library
    worker = sim_worker(iid, env)
    async with running(worker):
        for q, _ in before + after:
            assert (await env["client"].result(q, timeout_s=30)).error is None

    def mine(raw: bytes) -> DeadLetter | None:
        letter = DeadLetter.model_validate_json(raw)
        return letter if letter.topic == topic else None

    letters = await _read_topic(kafka_bootstrap, topics.DEAD_LETTERS, lambda o: len(o) >= 1, mine)
    assert len(letters) == 1 and letters[0].stage == "decode"
    assert "codec lz4" in letters[0].reason and "offsets 3-7" in letters[0].reason
    assert letters[0].offset == 7
    assert worker.counts["dead_letters"] == 1 and worker.counts["results"] == 6
