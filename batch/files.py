"""A batch job's files: the input lines, the output and error files, the status file.

Input: one JSON object per line, either an OpenAI Batch API request
(``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body"}``) or a Switchyard query body (``prompt`` or ``messages``, optional ``id``…, whose
``custom_id`` is its ``id`` or a stable hash). Both kinds may be mixed.

Query ids are stable per (job, custom id), so a resumed run sends the same ids and the
ledger, the router's dedupe and the workers never pay or run a line twice.

Files written (``out`` = ``--out``): ``out`` (one ``BatchOutputLine`` per completed line),
``<out stem>.errors.jsonl`` (bad lines, over-budget lines, router and engine errors), and
``<out stem>.batch.json`` (the batch object: OpenAI's lifecycle and request counts). A
resumed run keeps every output line and the errors of bad input lines (final), and tries
every other failed line again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas import BadMessage, ClusterConfig, Query
from schemas.openai_api import (
    BatchLineError,
    BatchObject,
    BatchOutputLine,
    BatchRequestLine,
    query_from_request,
)
from schemas.parse import validate_model

FINAL_ERROR_CODES = frozenset({"invalid_request"})  # kept by a resumed run; the rest are retried


@dataclass(frozen=True)
class JobFiles:
    input: Path
    output: Path
    errors: Path
    status: Path
    cancel: Path  # its existence asks a running job to cancel (``switchyard batch cancel``)

    @classmethod
    def for_output(cls, input_path: Path, output: Path) -> JobFiles:
        stem = output.name.removesuffix(".jsonl")
        return cls(
            input_path,
            output,
            output.with_name(f"{stem}.errors.jsonl"),
            output.with_name(f"{stem}.batch.json"),
            output.with_name(f"{stem}.cancel"),
        )


@dataclass(frozen=True)
class Line:
    """A valid input line: its query, and where it came from."""

    line_no: int
    custom_id: str
    endpoint: str
    query: Query


@dataclass(frozen=True)
class BadLine:
    line_no: int
    custom_id: str | None
    message: str
    param: str | None = None


def safe_job_name(text: str) -> str:
    """A job name usable in query ids and ledger keys."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", text)[:40] or "job"


def stable_id(job: str, custom_id: str) -> str:
    digest = hashlib.sha256(f"{job}\n{custom_id}".encode()).hexdigest()[:20]
    return f"batch-{job[:40]}-{digest}"


@dataclass(frozen=True)
class InputRules:
    """How lines become queries: the job, tenant override, default output cap, models."""

    job: str
    cluster: ClusterConfig
    tenant: str | None = None
    default_max_tokens: int | None = 256
    any_model: bool = False  # drop each line's ``model`` (OpenAI files name OpenAI models)


def read_input(path: Path, rules: InputRules) -> tuple[list[Line], list[BadLine]]:
    """Every line as a ``Line`` or a ``BadLine`` naming its problem; blank lines are skipped."""
    lines: list[Line] = []
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    for line_no, text in _numbered(path):
        try:
            line = _parse_line(line_no, text, rules)
        except _Bad as exc:
            bad.append(BadLine(line_no, exc.custom_id, exc.message, exc.param))
            continue
        if line.custom_id in seen:
            bad.append(
                BadLine(
                    line_no,
                    line.custom_id,
                    f"custom_id {line.custom_id!r} repeats line {seen[line.custom_id]}",
                    "custom_id",
                )
            )
            continue
        seen[line.custom_id] = line_no
        lines.append(line)
    return lines, bad


def _numbered(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as fh:
        for line_no, raw in enumerate(fh, start=1):
            text = raw.strip()
            if text:
                yield line_no, text


class _Bad(Exception):
    def __init__(self, message: str, custom_id: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.custom_id, self.param = message, custom_id, param


def _parse_line(line_no: int, text: str, rules: InputRules) -> Line:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Bad(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise _Bad(f"a line must be a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj or "body" in obj:
        return _openai_line(line_no, obj, rules)
    return _query_line(line_no, obj, text, rules)


def _openai_line(line_no: int, obj: dict[str, Any], rules: InputRules) -> Line:
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    try:
        req = validate_model(BatchRequestLine, obj, what="batch line")
    except BadMessage as exc:
        raise _Bad(exc.reason, custom_id, exc.field) from None
    body = dict(req.body)
    if rules.any_model:
        body.pop("model", None)
    _defaults(body, rules)
    try:
        q = query_from_request(
            body,
            req.url,
            query_id=stable_id(rules.job, req.custom_id),
            tenant=rules.tenant or "default",
        )
    except BadMessage as exc:
        raise _Bad(
            exc.reason, req.custom_id, f"body.{exc.field}" if exc.field else "body"
        ) from None
    _check_model(q, rules, req.custom_id, "body.model")
    return Line(line_no, req.custom_id, req.url, q)


def _query_line(line_no: int, obj: dict[str, Any], text: str, rules: InputRules) -> Line:
    given = obj.get("id")
    custom_id = given if isinstance(given, str) else None
    body = dict(obj)
    body.setdefault("id", stable_id(rules.job, f"line {line_no}\n{text}"))
    if rules.tenant is not None:
        body["tenant"] = rules.tenant
    if rules.any_model:
        body.pop("model", None)
    _defaults(body, rules)
    try:
        q = validate_model(Query, body, what="query")
    except BadMessage as exc:
        raise _Bad(exc.reason, custom_id, exc.field) from None
    _check_model(q, rules, custom_id or q.id, "model")
    endpoint = "/v1/chat/completions" if q.kind == "chat" else "/v1/completions"
    return Line(line_no, custom_id or q.id, endpoint, q)


def _defaults(body: dict[str, Any], rules: InputRules) -> None:
    if (
        rules.default_max_tokens is not None
        and body.get("max_tokens") is None
        and body.get("max_completion_tokens") is None
    ):
        body["max_tokens"] = rules.default_max_tokens


def _check_model(q: Query, rules: InputRules, custom_id: str, param: str) -> None:
    if q.model is None:
        return
    try:
        rules.cluster.models_named(q.model)
    except KeyError as exc:
        raise _Bad(
            f"{exc.args[0]} (or run with --any-model to let the router choose)", custom_id, param
        ) from None


def cost_bound_usd(q: Query, cluster: ClusterConfig) -> float:
    """An upper bound of what ``q`` can cost on any model it may be routed to."""
    allowed = set(cluster.models_named(q.model)) if q.model else None
    return max(m.max_cost_usd(q) for m in cluster.models if allowed is None or m.name in allowed)


# ----------------------------------------------------------------------------- outputs


def read_lines(path: Path) -> list[BatchOutputLine]:
    """Lines of an output or error file written by a job (a torn last line is ignored)."""
    out: list[BatchOutputLine] = []
    if not path.exists():
        return out
    with open(path, encoding="utf-8") as fh:
        for raw in fh:
            try:
                out.append(BatchOutputLine.model_validate_json(raw))
            except ValueError:
                continue
    return out


def line_cost_usd(line: BatchOutputLine) -> float:
    return float((line.switchyard or {}).get("cost_usd") or 0.0)


def bad_line_record(bad: BadLine, job: str) -> BatchOutputLine:
    return BatchOutputLine(
        id=f"batch_req_{job}_line{bad.line_no}",
        custom_id=bad.custom_id,
        error=BatchLineError(
            code="invalid_request", message=bad.message, line=bad.line_no, param=bad.param
        ),
        switchyard={"line": bad.line_no, "cost_usd": 0.0},
    )


def rewrite(path: Path, lines: list[BatchOutputLine]) -> None:
    """Replace ``path`` with ``lines`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line.model_dump_json() + "\n")
    os.replace(tmp, path)


def write_status(path: Path, status: BatchObject) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(status.model_dump_json(indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_status(path: Path) -> BatchObject | None:
    if not path.exists():
        return None
    try:
        return BatchObject.model_validate_json(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
