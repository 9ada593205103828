"""Server-sent events as OpenAI-compatible servers (vLLM) stream them, parsed incrementally.

``SSEParser.feed`` takes text as it arrives (chunk boundaries anywhere, ``\\n``, ``\\r\\n`` or
``\\r`` line ends) and returns the ``data`` payload of every event completed so far;
``interpret`` reads one payload of ``/v1/completions`` or ``/v1/chat/completions``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SSEParser:
    """Incremental parser for ``text/event-stream`` (WHATWG rules for the fields we use)."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._pending_cr = False

    def feed(self, text: str) -> list[str]:
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the \n of a \r\n split across chunks
        self._pending_cr = False
        self._buf += text
        out: list[str] = []
        while True:
            cut = _line_end(self._buf)
            if cut is None:
                break
            end, width = cut
            line = self._buf[:end]
            if self._buf[end] == "\r" and end + 1 == len(self._buf):
                self._pending_cr = True  # maybe the first half of \r\n
            self._buf = self._buf[end + width :]
            self._line(line, out)
        return out

    def finish(self) -> list[str]:
        """Flush at end of stream: a last event without its blank line still counts."""
        out: list[str] = []
        if self._buf:
            self._line(self._buf, out)
            self._buf = ""
        self._line("", out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if line == "":
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return  # comment / keep-alive
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        # "event", "id", "retry" are not used by OpenAI-compatible streams


def _line_end(buf: str) -> tuple[int, int] | None:
    for i, ch in enumerate(buf):
        if ch == "\n":
            return i, 1
        if ch == "\r":
            return (i, 2) if buf[i + 1 : i + 2] == "\n" else (i, 1)
    return None


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk: its text (may be empty), usage when present, finish reason, error."""

    text: str = ""
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    has_choice: bool = False


def interpret(payload: str, chat: bool) -> Chunk:
    """Read one ``data`` payload; malformed JSON becomes an error chunk naming the problem."""
    if payload.strip() == DONE:
        return Chunk(done=True)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as exc:
        return Chunk(
            error=f"malformed stream chunk ({exc.msg} at column {exc.colno}): {payload[:120]!r}"
        )
    if not isinstance(obj, dict):
        return Chunk(error=f"stream chunk is not a JSON object: {payload[:120]!r}")
    if "error" in obj or obj.get("object") == "error":
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        return Chunk(error=f"server error in stream: {msg}")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else None
    text = ""
    finish: str | None = None
    choices = obj.get("choices") or []
    has_choice = False
    if isinstance(choices, list) and choices:
        first = choices[0]
        if isinstance(first, dict):
            has_choice = True
            if chat:
                delta = first.get("delta") or {}
                content = delta.get("content") if isinstance(delta, dict) else None
                text = content if isinstance(content, str) else ""
                if not text and isinstance(delta, dict) and delta.get("tool_calls"):
                    text = json.dumps(delta["tool_calls"])
            else:
                t = first.get("text")
                text = t if isinstance(t, str) else ""
            fr = first.get("finish_reason")
            finish = fr if isinstance(fr, str) else None
    return Chunk(text=text, usage=usage, finish_reason=finish, has_choice=has_choice)


def error_message(body: bytes, limit: int = 500) -> str:
    """The message of an OpenAI/vLLM error body, else the body's start."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text[:limit].strip() or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:limit]
        if isinstance(err, str):
            return err[:limit]
        if isinstance(obj.get("message"), str):
            return str(obj["message"])[:limit]
    return text[:limit]
