"""``OrderedAcker``: inputs are acknowledged to Faust in offset order per partition, never
past an unfinished one, whatever order they were opened and finished in."""

from __future__ import annotations

from dataclasses import dataclass, field

from streams.app import OrderedAcker
from streams.service import Inbound


@dataclass
class _Message:
    tp: str
    acked: bool = False


@dataclass
class _Event:
    message: _Message
    log: list[int] = field(default_factory=list)
    offset: int = 0

    def ack(self) -> None:
        self.message.acked = True
        self.log.append(self.offset)


def _inputs(offsets: list[int], log: list[int]) -> list[Inbound]:
    return [
        Inbound(
            raw=b"",
            topic="queries",
            partition=0,
            offset=o,
            handle=_Event(_Message("queries/0"), log, o),
        )  # fmt: skip
        for o in offsets
    ]


def test_acks_follow_offsets_not_finishing_order() -> None:
    log: list[int] = []
    acker = OrderedAcker()
    items = _inputs([10, 11, 12], log)
    acker.opened(items)
    acker.finished(items[2])
    acker.finished(items[1])
    assert log == []  # 10 is unfinished
    acker.finished(items[0])
    assert log == [10, 11, 12]


def test_buffered_events_opened_before_the_refetched_ones_wait_for_them() -> None:
    """After a rebalance the stream may hand over events it had buffered (11, 12) before
    the re-fetched ones from the committed offset (10): finishing 11 must not acknowledge
    it while 10 is open (Faust would then commit 12, past the unfinished query 10)."""
    log: list[int] = []
    acker = OrderedAcker()
    buffered = _inputs([11, 12], log)
    refetched = _inputs([10], log)
    acker.opened(buffered)
    acker.opened(refetched)
    acker.finished(buffered[0])
    acker.finished(buffered[1])
    assert log == []
    acker.finished(refetched[0])
    assert log == [10, 11, 12]


def test_abandoned_inputs_are_never_acknowledged() -> None:
    log: list[int] = []
    acker = OrderedAcker()
    items = _inputs([5, 6], log)
    acker.opened(items)
    assert acker.abandon_all() == 2
    acker.finished(items[0])
    acker.finished(items[1])
    assert log == [] and all(it.handle.message.acked for it in items)
