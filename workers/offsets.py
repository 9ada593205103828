"""Which Kafka offsets a worker may commit: only those whose every earlier message is finished.

Messages of one partition are processed concurrently and finish out of order; committing
offset ``o`` tells Kafka that everything before ``o`` is done, so the committable offset of
a partition is its lowest unfinished offset (or one past the highest seen when none is
unfinished). A message that never finishes (its result could not be published) holds the
partition's commit back, so it is re-delivered after a restart: at-least-once.

The same offset can be in flight twice: after a group re-join the consumer re-fetches from
the last commit while the first copy still runs. Offsets are therefore counted, not just
marked: the re-fetched copy finishing (skipped as a duplicate) must not release the offset
that the first copy still holds, or the commit would pass a query whose result may never
be published (lost across a broker restart in the faults suite).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")  # aiokafka.TopicPartition in the worker; anything hashable in tests


@dataclass
class _Partition:
    unfinished: dict[int, int] = field(default_factory=dict)  # offset -> copies in flight
    highest: int = -1
    committed: int = -1


class OffsetTracker(Generic[P]):
    def __init__(self) -> None:
        self._parts: dict[P, _Partition] = {}

    def started(self, tp: P, offset: int) -> None:
        part = self._parts.setdefault(tp, _Partition())
        part.unfinished[offset] = part.unfinished.get(offset, 0) + 1
        part.highest = max(part.highest, offset)

    def finished(self, tp: P, offset: int) -> None:
        part = self._parts.get(tp)
        if part is None:
            return
        left = part.unfinished.get(offset, 0) - 1
        if left > 0:
            part.unfinished[offset] = left
        else:
            part.unfinished.pop(offset, None)

    def committable(self) -> dict[P, int]:
        """Offsets to commit now (next offset to read), only where they moved since ``committed``."""
        out: dict[P, int] = {}
        for tp, part in self._parts.items():
            nxt = min(part.unfinished) if part.unfinished else part.highest + 1
            if nxt > part.committed and part.highest >= 0:
                out[tp] = nxt
        return out

    def committed(self, offsets: dict[P, int]) -> None:
        for tp, off in offsets.items():
            if tp in self._parts:
                self._parts[tp].committed = max(self._parts[tp].committed, off)

    def forget(self, tps: list[P]) -> None:
        """Drop partitions this consumer no longer owns (after a rebalance)."""
        for tp in tps:
            self._parts.pop(tp, None)

    def unfinished(self) -> int:
        return sum(sum(p.unfinished.values()) for p in self._parts.values())
