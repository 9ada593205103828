"""Relaying a streaming query's text to the front door that waits for it (``relay.<gateway>``).

A query produced with ``relay_topic`` (the HTTP gateway does so for ``stream: true``)
gets its text sent there as the engine streams it: ``RelayChunk`` bodies keyed by query
id (one partition, so in order), numbered by ``seq``, coalesced while a send is under way
(one message per engine chunk at low load, fewer at high load), ending with a ``done``
chunk that carries the finish reason and token counts. The relay is advisory: a failed
send is counted, never fatal — the query's ``Result`` on ``results`` stays the answer of
record, and the gateway falls back to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from schemas import RelayChunk
from workers.backends.base import Generation

log = logging.getLogger(__name__)

Send = Callable[[str, bytes, bytes], Awaitable[Any]]  # (topic, key, value) -> enqueued


class RelayWriter:
    """One query's relay: ``text`` from the backend's callback, ``finish`` once it is done."""

    def __init__(self, send: Send, topic: str, query_id: str, attempt: int, model: str) -> None:
        self._send = send
        self.model = model
        self.topic = topic
        self.query_id = query_id
        self.attempt = attempt
        self.seq = 0
        self.failed = 0
        self._buf: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def text(self, delta: str) -> None:
        if not delta:
            return
        self._buf.append(delta)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        while self._buf:
            text, self._buf = "".join(self._buf), []
            await self._emit(
                RelayChunk(
                    query_id=self.query_id,
                    model=self.model,
                    attempt=self.attempt,
                    seq=self.seq,
                    text=text,
                )
            )

    async def _emit(self, chunk: RelayChunk) -> None:
        self.seq += 1
        try:
            await self._send(
                self.topic,
                self.query_id.encode(),
                chunk.model_dump_json(exclude_none=True).encode(),
            )
        except Exception as exc:  # noqa: BLE001 - advisory: the Result is the answer of record
            self.failed += 1
            log.debug("relay of %s to %s failed: %s", self.query_id, self.topic, exc)

    async def finish(self, gen: Generation) -> None:
        """Send what is buffered, then the ``done`` chunk."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        await self._drain()
        await self._emit(
            RelayChunk(
                query_id=self.query_id,
                model=self.model,
                attempt=self.attempt,
                seq=self.seq,
                done=True,
                finish_reason=gen.finish_reason,
                prompt_tokens=gen.prompt_tokens,
                output_tokens=gen.output_tokens,
                cached_tokens=gen.cached_tokens,
                error=gen.error,
            )
        )
