"""A record batch a consumer cannot decode becomes one marked record, never a crash loop.

aiokafka decodes a fetched record batch (CRC check, decompression, record parsing) inside
``getmany``/``getone``. An ``UnsupportedCodecError`` or ``CorruptRecordException`` raised
there comes out of every poll at the same offset, and a restarted consumer reads the same
batch again: one bad batch stops its partition for good (issue 16: an lz4 record made the
router crash at the same offset on every restart). ``install()`` makes every consumer of
the process turn such a batch into **one** record at the batch's last offset, with no key,
no value and the header ``UNDECODABLE_HEADER`` holding the reason, and moves the position
past the batch. Routers and workers dead-letter it with ``undecodable_reason`` (stage
``decode``) and go on; the committed offset then passes the batch, so nothing loops.

The batch's own bytes are not kept in the dead letter (aiokafka's C batch does not expose
them); its topic, partition and offset range are, so it can be read again from Kafka.

This wraps aiokafka's ``PartitionRecords`` (``aiokafka.consumer.fetcher``), a private
class: ``tests/test_kafka_records.py`` checks it against the pinned aiokafka versions on
the real broker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

UNDECODABLE_HEADER = "x-switchyard-undecodable"
_CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}
_installed = False


def undecodable_reason(
    headers: Iterable[tuple[str, bytes | None]] | Mapping[str, bytes | None] | None, value: Any
) -> str | None:
    """The reason a record stands for an undecodable batch, or None for an ordinary record.

    Only a record with no value carries the mark (a producer that sets the header on a
    record with a body gets its body validated as usual). ``headers``: aiokafka's tuples
    or Faust's mapping.
    """
    if value is not None or not headers:
        return None
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    for name, raw in pairs:
        if name == UNDECODABLE_HEADER:
            return (raw or b"").decode("utf-8", "replace") or "undecodable record batch"
    return None


@dataclass(frozen=True)
class _MarkRecord:
    """Stands in for the records of an undecodable batch (what ``_consumer_record`` reads)."""

    offset: int
    reason: str
    key: None = None
    value: None = None
    timestamp: int = -1
    timestamp_type: int = 0
    checksum: None = None

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        return [(UNDECODABLE_HEADER, self.reason.encode())]


class _GuardedBatch:
    """One fetched batch whose CRC failure or decoding error yields a mark record instead."""

    def __init__(self, batch: Any, where: str) -> None:
        self._batch = batch
        self._where = where
        self._crc_ok = True

    def __getattr__(self, name: str) -> Any:  # base_offset, producer_id, is_control_batch, …
        return getattr(self._batch, name)

    def validate_crc(self) -> bool:
        self._crc_ok = bool(self._batch.validate_crc())
        return True  # the mismatch is reported as a mark record, not raised

    def _describe(self) -> str:
        first = getattr(self._batch, "base_offset", None)
        last = int(self._batch.next_offset) - 1
        span = f"offsets {first}-{last}" if first is not None else f"offset {last}"
        codec = _CODECS.get(int(getattr(self._batch, "compression_type", 0) or 0), "unknown")
        return f"record batch at {span} of {self._where} (codec {codec})"

    def _mark(self, why: str) -> _MarkRecord:
        reason = f"{self._describe()} could not be decoded: {why}"
        log.error("%s", reason)
        return _MarkRecord(int(self._batch.next_offset) - 1, reason)

    def __next__(self) -> Any:  # aiokafka reads a control batch's marker with next()
        return next(self._batch)

    def __iter__(self) -> Iterator[Any]:
        if not self._crc_ok:
            yield self._mark("CRC mismatch (corrupt on disk or in transit)")
            return
        try:
            yield from self._batch
        except Exception as exc:  # UnsupportedCodecError, CorruptRecordException, a codec's own
            yield self._mark(_why(exc))


class _GuardedRecords:
    """A fetch response's batches; a batch whose header cannot even be read ends the fetch
    with a mark record at the current position (the next fetch starts after it)."""

    def __init__(self, records: Any, where: str, position: Callable[[], int]) -> None:
        self._records = records
        self._where = where
        self._position = position
        self._broken: str | None = None

    def has_next(self) -> bool:
        return self._broken is not None or bool(self._records.has_next())

    def next_batch(self) -> Any:
        if self._broken is not None:
            return _BrokenBatch(self._position(), self._broken, self._where, self)
        try:
            return _GuardedBatch(self._records.next_batch(), self._where)
        except Exception as exc:
            self._broken = _why(exc)
            return _BrokenBatch(self._position(), self._broken, self._where, self)

    def done(self) -> None:
        self._broken = None
        self._records = _Empty()


class _Empty:
    def has_next(self) -> bool:
        return False


class _BrokenBatch:
    """The rest of a fetch response after a batch header failed to parse."""

    is_control_batch = False
    is_transactional = False
    producer_id = None

    def __init__(self, offset: int, why: str, where: str, owner: _GuardedRecords) -> None:
        self.base_offset = offset
        self.next_offset = offset + 1
        self._why = why
        self._where = where
        self._owner = owner

    def validate_crc(self) -> bool:
        return True

    def __iter__(self) -> Iterator[Any]:
        self._owner.done()
        reason = f"record batch at offset {self.base_offset} of {self._where} could not be read: {self._why}"
        log.error("%s", reason)
        yield _MarkRecord(self.base_offset, reason)


def _why(exc: BaseException) -> str:
    text, name = str(exc), type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}"


def install() -> None:
    """Guard every aiokafka consumer of this process (idempotent; call before consuming)."""
    global _installed
    if _installed:
        return
    from aiokafka.consumer import fetcher

    base = fetcher.PartitionRecords

    class GuardedPartitionRecords(base):  # type: ignore[misc, valid-type]
        def __init__(self, tp: Any, records: Any, *args: Any, **kwargs: Any) -> None:
            where = f"{tp.topic}[{tp.partition}]"
            guarded = _GuardedRecords(records, where, lambda: int(self.next_fetch_offset))
            super().__init__(tp, guarded, *args, **kwargs)

    fetcher.PartitionRecords = GuardedPartitionRecords
    _installed = True
