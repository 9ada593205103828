"""``OrderedAcker``: inputs are acknowledged to Faust in offset order per partition, never
past an unfinished one, whatever order they were opened and finished in."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from weakref import WeakSet

from faust.transport.consumer import Consumer as FaustConsumer
from faust.types import TP
from faust.types.tuples import ConsumerMessage
from intervaltree import IntervalTree

from streams.app import OrderedAcker
from streams.service import Inbound


@dataclass(eq=False)  # hashed by identity, like Faust's messages
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


class _FaustOffsets:
    """Faust's own offset bookkeeping (``Consumer.ack`` and ``Consumer._new_offset``, the
    real methods) on the state they use, without a broker."""

    ack = FaustConsumer.ack
    _new_offset = FaustConsumer._new_offset

    def __init__(self) -> None:
        self._committed_offset: defaultdict[Any, int | None] = defaultdict(lambda: None)
        self._acked: defaultdict[Any, list[int]] = defaultdict(list)
        self._acked_index: defaultdict[Any, set[int]] = defaultdict(set)
        self._gap: defaultdict[Any, IntervalTree] = defaultdict(IntervalTree)
        self._unacked_messages: WeakSet[ConsumerMessage] = WeakSet()
        self._n_acked = 0
        self._waiting_for_ack = None
        self.app = SimpleNamespace(topics=SimpleNamespace(acks_enabled_for=lambda _topic: True))

    def revoke(self, tp: TP) -> None:
        """What ``Consumer.on_partitions_revoked`` forgets of a revoked partition."""
        for state in (self._acked, self._acked_index, self._committed_offset, self._gap):
            state.pop(tp, None)


@dataclass
class _FaustEvent:
    """A stream event: acking drops one reference; the last one acks to the consumer."""

    message: ConsumerMessage
    consumer: _FaustOffsets

    def ack(self) -> None:
        self.message.ack(self.consumer)


def _handed_out(consumer: _FaustOffsets, tp: TP, offsets: list[int]) -> list[Inbound]:
    items = []
    for o in offsets:
        m = ConsumerMessage(tp.topic, tp.partition, o, 0.0, 0, None, b"k", b"v", None, tp=tp)
        m.incref()  # the stream's reference
        consumer._unacked_messages.add(m)
        items.append(
            Inbound(raw=b"", topic=tp.topic, partition=tp.partition, offset=o, handle=_FaustEvent(m, consumer))
        )  # fmt: skip
    return items


def _agent_takes(acker: OrderedAcker, items: list[Inbound]) -> list[Inbound]:
    """What the agent does with a window ``take_events`` yields: one extra reference per
    event, open them in the acker, then ``take_events`` acks (drops its reference)."""
    for it in items:
        it.handle.message.incref()
    kept = acker.opened(items)
    for it in items:
        it.handle.ack()
    return kept


def test_events_buffered_before_a_rebalance_are_not_committed_past_the_held_queries() -> None:
    """Scenario 4's loss (issue 16): query 10 is held; 11 and 12 sit in ``take_events``'
    buffer when the broker's return starts a rebalance. The router gives up its unfinished
    queries and Faust forgets the partition's committed offset; then the buffer is handed
    to the agent and routed. Acknowledging 11 and 12 then lets Faust commit 13 (without a
    committed offset it checks no gap at the head): query 10 is never read again."""
    tp = TP("queries", 0)
    consumer = _FaustOffsets()
    consumer._committed_offset[tp] = 10
    acker = OrderedAcker()
    held, *buffered = _handed_out(consumer, tp, [10, 11, 12])
    assert _agent_takes(acker, [held]) == [held]  # routed and held: stays open

    consumer.revoke(tp)  # the rebalance: Faust, then the router's give-up
    assert acker.abandon_all(list(consumer._unacked_messages)) == 1
    assert not acker.keep(held)

    routed = _agent_takes(acker, buffered)  # the buffer reaches the agent after the give-up
    assert routed == []  # given up too: re-delivered, not routed from a stale copy
    for it in buffered:
        acker.finished(it)
    acker.finished(held)
    assert consumer._new_offset(tp) is None  # nothing to commit: 10 is read again

    consumer._committed_offset[tp] = 10  # assigned again: Faust seeks to the committed offset
    refetched = _handed_out(consumer, tp, [10, 11, 12])
    assert _agent_takes(acker, refetched) == refetched
    for it in reversed(refetched):
        acker.finished(it)
    assert consumer._new_offset(tp) == 13
