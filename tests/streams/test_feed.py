"""``WindowFeed``: a window closes ``within_s`` after its oldest record was produced (its
Kafka timestamp, credited for ``credit_s`` at most), or once ``n`` records wait."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from streams.feed import WindowFeed


@dataclass
class _Record:
    offset: int
    timestamp: float  # seconds, as Faust's messages carry it


def _records(n: int, age_s: float, start: int = 0) -> list[_Record]:
    produced_s = time.time() - age_s
    return [_Record(start + k, produced_s) for k in range(n)]


async def _timed_take(feed: WindowFeed, n: int, within_s: float) -> tuple[list[_Record], float]:
    t0 = time.monotonic()
    got = await feed.take(n, within_s)
    return got, time.monotonic() - t0


async def test_full_window_returns_at_once() -> None:
    feed = WindowFeed("queries", capacity=100, credit_s=0.05)
    feed.put(_records(10, age_s=0.0))
    got, waited_s = await _timed_take(feed, 4, within_s=5.0)
    assert [r.offset for r in got] == [0, 1, 2, 3]
    assert waited_s < 1.0
    assert len(feed) == 6


async def test_fresh_record_waits_the_whole_window() -> None:
    feed = WindowFeed("queries", capacity=100, credit_s=0.2)
    feed.put(_records(1, age_s=0.0))
    got, waited_s = await _timed_take(feed, 10, within_s=0.3)
    assert len(got) == 1
    assert waited_s >= 0.25  # nothing credited: it was produced just now


async def test_time_before_arrival_counts_toward_the_window() -> None:
    # produced 0.2 s before it reached the feed (broker, fetch wait): 0.2 s of its 0.3 s
    # window have passed already
    feed = WindowFeed("queries", capacity=100, credit_s=0.25)
    feed.put(_records(1, age_s=0.2))
    got, waited_s = await _timed_take(feed, 10, within_s=0.3)
    assert len(got) == 1
    assert 0.05 <= waited_s < 0.2


async def test_credit_is_capped() -> None:
    # a producer clock 10 s behind (or a record that waited 10 s in Kafka): credited
    # credit_s only, so windows keep at least within_s - credit_s of batching
    feed = WindowFeed("queries", capacity=100, credit_s=0.1)
    feed.put(_records(1, age_s=10.0))
    _, waited_s = await _timed_take(feed, 10, within_s=0.3)
    assert waited_s >= 0.15


async def test_clock_ahead_is_not_a_longer_window() -> None:
    # a producer clock ahead of the router's: the record looks produced in the future;
    # the window is timed from its arrival, never longer
    feed = WindowFeed("queries", capacity=100, credit_s=0.1)
    feed.put(_records(1, age_s=-5.0))
    _, waited_s = await _timed_take(feed, 10, within_s=0.2)
    assert 0.15 <= waited_s < 1.0


async def test_rest_of_a_backlog_is_timed_from_its_own_oldest_record() -> None:
    feed = WindowFeed("queries", capacity=100, credit_s=0.1)
    feed.put(_records(5, age_s=1.0))
    first, _ = await _timed_take(feed, 2, within_s=0.3)
    # the three left were produced a second ago: credited 0.1 s of their 0.3 s window
    rest, waited_s = await _timed_take(feed, 10, within_s=0.3)
    assert [r.offset for r in first] == [0, 1]
    assert [r.offset for r in rest] == [2, 3, 4]
    assert 0.15 <= waited_s < 0.29


async def test_records_arriving_during_the_window_join_it() -> None:
    feed = WindowFeed("queries", capacity=100, credit_s=0.0)
    feed.put(_records(1, age_s=0.0))

    async def later() -> None:
        await asyncio.sleep(0.05)
        feed.put(_records(2, age_s=0.0, start=1))

    task = asyncio.create_task(later())
    got, waited_s = await _timed_take(feed, 3, within_s=2.0)
    await task
    assert [r.offset for r in got] == [0, 1, 2]  # full: returned before the window ran out
    assert waited_s < 1.0


async def test_capacity_is_backpressure() -> None:
    feed = WindowFeed("queries", capacity=3)
    feed.put(_records(3, age_s=0.0))
    waiting = asyncio.create_task(feed.wait_room())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await feed.take(2, within_s=0.0)
    await asyncio.wait_for(waiting, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 1, "credit_s": -1.0}, "credit_s"),
        ({"capacity": 1, "fetch_min_bytes": 0}, "fetch_min_bytes"),
        ({"capacity": 1, "fetch_wait_s": -0.1}, "fetch_wait_s"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        WindowFeed("queries", **kwargs)  # type: ignore[arg-type]


async def test_take_needs_a_positive_size() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        await WindowFeed("queries", capacity=1).take(0, 0.1)


async def test_router_consumer_fetches_as_the_feed_asks() -> None:
    # the aiokafka consumer Faust's thread builds for a router (not started: no broker needed)
    import faust

    from streams.feed import BatchDrain

    app = faust.App("feed-test", broker="kafka://127.0.0.1:9")
    app.query_feed = WindowFeed(  # type: ignore[attr-defined]
        "queries", capacity=10, fetch_min_bytes=12_345, fetch_wait_s=0.007
    )
    drain = BatchDrain(
        app.transport,
        callback=app.topics.on_message,
        on_partitions_revoked=app._on_partitions_revoked,
        on_partitions_assigned=app._on_partitions_assigned,
    )
    consumer = drain._new_consumer_thread()._create_worker_consumer(app.transport)
    assert consumer._fetch_min_bytes == 12_345
    assert consumer._fetch_max_wait_ms == 7


def test_the_fetch_wait_defaults_to_half_the_window() -> None:
    from streams.service import RouterConfig

    assert RouterConfig().fetch_wait == 0.025
    assert RouterConfig(window_s=0.01).fetch_wait == 0.005
    assert RouterConfig(window_s=0.01, fetch_wait_s=0.0).fetch_wait == 0.0
