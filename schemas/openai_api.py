"""OpenAI API bodies at Switchyard's front doors: requests → ``Query``, ``Result`` → responses.

One place builds and reads them for the HTTP gateway (``gateway/``) and the batch job
engine (``batch/``):

- ``query_from_request``: a ``/v1/completions`` or ``/v1/chat/completions`` body (the
  OpenAI fields ``Query`` accepts) plus the ids the front door assigns; errors name the
  field (``BadMessage.field``), like OpenAI's ``param``;
- ``completion_body`` / ``chat_body``: the OpenAI response for a ``Result``, with the
  routing facts (instance, TTFT, cost) under a ``switchyard`` key that OpenAI clients
  ignore;
- the streaming chunk bodies (``text_completion`` / ``chat.completion.chunk``);
- the OpenAI Batch API file lines: input (``BatchRequestLine``), output and error lines
  (``BatchOutputLine``), and the batch object (``BatchObject``, OpenAI's lifecycle and
  ``request_counts``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import Result
from schemas.parse import BadMessage, Limits, validate_model
from schemas.query import Query

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")

# fields a front door sets itself; a client that sends them gets a clear error
_ASSIGNED = ("id", "tenant", "relay_topic", "created_at")


def kind_of(endpoint: str) -> Literal["completion", "chat"]:
    if endpoint == "/v1/chat/completions":
        return "chat"
    if endpoint == "/v1/completions":
        return "completion"
    raise BadMessage(f"url must be one of {list(ENDPOINTS)}, got {endpoint!r}", "url")


def query_from_request(
    body: Any,
    endpoint: str,
    *,
    query_id: str,
    tenant: str,
    created_at: float | None = None,
    relay_topic: str | None = None,
    limits: Limits = Limits(),
) -> Query:
    """The ``Query`` for one OpenAI request body; ``BadMessage`` naming the field otherwise."""
    kind = kind_of(endpoint)
    if not isinstance(body, dict):
        raise BadMessage(f"the request body must be a JSON object, got {type(body).__name__}")
    for name in _ASSIGNED:
        if name in body:
            raise BadMessage(f"{name} is set by Switchyard, not by the request", name)
    wanted, other = ("messages", "prompt") if kind == "chat" else ("prompt", "messages")
    if wanted not in body:
        raise BadMessage(f"{wanted} is required for {endpoint}", wanted)
    if other in body:
        raise BadMessage(f"{other} is not a field of {endpoint} (use {wanted})", other)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) != 1:
        raise BadMessage(
            f"prompt: a list of {len(prompt)} prompts asks for {len(prompt)} completions; "
            "send one request per prompt",
            "prompt",
        )
    value = dict(body, id=query_id, tenant=tenant)
    if created_at is not None:
        value["created_at"] = created_at
    if relay_topic is not None:
        value["relay_topic"] = relay_topic
    return validate_model(Query, value, limits, "request")


# ----------------------------------------------------------------------------- responses


def usage(result: Result) -> dict[str, Any]:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens`` when the engine
    reported its prefix-cache hits."""
    out: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.output_tokens,
        "total_tokens": result.prompt_tokens + result.output_tokens,
    }
    if result.cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return out


def finish_reason(query: Query, result: Result) -> str:
    """The engine's finish reason; else ``length`` when the output reached the query's cap."""
    if result.finish_reason:
        return result.finish_reason
    cap = query.output_cap_tokens()
    return "length" if cap is not None and result.output_tokens >= cap else "stop"


def routing_facts(result: Result) -> dict[str, Any]:
    """What Switchyard adds to a response (OpenAI clients keep unknown keys as extras)."""
    return {
        "query_id": result.query_id,
        "instance_id": result.instance_id,
        "ttft_ms": result.ttft_ms,
        "e2e_ms": result.e2e_ms,
        "cost_usd": result.cost_usd,
        "slo_met": result.slo_met,
    }


def response_id(query: Query) -> str:
    return ("chatcmpl-" if query.kind == "chat" else "cmpl-") + query.id


def completion_body(query: Query, result: Result, created: int) -> dict[str, Any]:
    """A ``text_completion`` object (``openai.types.Completion``)."""
    return {
        "id": response_id(query),
        "object": "text_completion",
        "created": created,
        "model": result.model,
        "choices": [
            {
                "index": 0,
                "text": result.text,
                "logprobs": None,
                "finish_reason": finish_reason(query, result),
            }
        ],
        "usage": usage(result),
        "switchyard": routing_facts(result),
    }


def chat_body(query: Query, result: Result, created: int) -> dict[str, Any]:
    """A ``chat.completion`` object (``openai.types.chat.ChatCompletion``)."""
    return {
        "id": response_id(query),
        "object": "chat.completion",
        "created": created,
        "model": result.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": finish_reason(query, result),
            }
        ],
        "usage": usage(result),
        "switchyard": routing_facts(result),
    }


def response_body(query: Query, result: Result, created: int) -> dict[str, Any]:
    return (chat_body if query.kind == "chat" else completion_body)(query, result, created)


def chunk_body(
    query: Query,
    created: int,
    model: str,
    text: str | None,
    finish: str | None = None,
    *,
    first: bool = False,
    usage_of: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk; ``text=None`` with ``usage_of`` is the final usage chunk."""
    chat = query.kind == "chat"
    body: dict[str, Any] = {
        "id": response_id(query),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
    }
    if text is not None:
        if chat:
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            body["choices"] = [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            ]
        else:
            body["choices"] = [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            ]
    if usage_of is not None:
        body["usage"] = usage_of
    return body


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----------------------------------------------------------------------------- Batch API

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]


class BatchRequestLine(BaseModel):
    """One line of an OpenAI Batch API input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]


class BatchResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchLineError(BaseModel):
    """Why a line failed: ``code`` is one of ``invalid_request`` (a bad line),
    ``over_budget`` (its worst-case cost did not fit in what was left of the budget),
    ``not_routed`` (the router gave up on it), ``engine_error`` (the engine failed it),
    ``cancelled`` (the job was cancelled before it ran) or ``timeout``."""

    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchOutputLine(BaseModel):
    """One line of the output file (a response) or of the error file (an error).

    ``switchyard`` holds the input line number, query id and the line's cost (the job's
    spend across resumed runs is the sum over both files).
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    custom_id: str | None
    response: BatchResponse | None = None
    error: BatchLineError | None = None
    switchyard: dict[str, Any] | None = None


class BatchRequestCounts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total: int = Field(ge=0)
    completed: int = Field(ge=0)
    failed: int = Field(ge=0)


class BatchObject(BaseModel):
    """The batch object (``openai.types.Batch``) written as the job's status file.

    File ids are the paths of the job's files. Switchyard's own figures (spend across
    every run of the job, budget, runs) are under ``switchyard``.
    """

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    expires_at: int | None = None
    expired_at: int | None = None
    errors: dict[str, Any] | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None
    switchyard: dict[str, Any] = Field(default_factory=dict)
