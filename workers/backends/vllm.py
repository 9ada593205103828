"""Backend for a vLLM (or any OpenAI-compatible) server: httpx async streaming.

``/v1/completions`` for a ``prompt`` query, ``/v1/chat/completions`` for ``messages``,
always streamed (``stream_options.include_usage`` asked for). TTFT is measured at the
first chunk carrying text. Token counts come from the final usage chunk when the server
honours ``include_usage``, else from counted text chunks (vLLM streams one token per
chunk). Connection failures (nothing reached the server) are retried with exponential
backoff, and so are answers of 429 (rate limited) and 503 (overloaded), which refuse the
request before any work, after their Retry-After when they give one (at most
``VllmConfig.max_retry_after_s``); anything else — other HTTP errors, a broken stream, a
timeout — becomes an error ``Generation`` at once, since the server may already have done
the work.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from schemas import Query
from wiring.sse import SSEParser, error_message, interpret
from workers.backends.base import (
    EngineLoad,
    EngineUnavailable,
    Generation,
    GenerationRequest,
    ProgressFn,
    TextFn,
)
from workers.prefix_reconcile import parse_prefix_counters

log = logging.getLogger(__name__)

# OpenAI request fields passed through unchanged when the query sets them
_PASS_COMMON = (
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",  # vLLM's sampling extensions
    "min_p",
    "repetition_penalty",
    "min_tokens",
)
_PASS_COMPLETION = ("logprobs", "suffix", "echo")
_PASS_CHAT = ("top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls")
_METRIC = re.compile(
    r"^(vllm:num_requests_(?:running|waiting)|vllm:(?:gpu|kv)_cache_usage_perc)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+\-]+|NaN)\s*$"
)

_CONTEXT = re.compile(r"maximum context length is (\d+)")
_INPUT = re.compile(r"(\d+) (?:in the messages|in the prompt|input tokens)")


_RETRY_STATUS = frozenset({429, 503})  # too many requests, overloaded: worth a retry


def retry_after_s(header: str | None) -> float | None:
    """A Retry-After header's wait in seconds: its delay-seconds form (RFC 9110 § 10.2.3;
    providers send that one), else None (absent, an HTTP date, or unreadable: then the
    backoff applies)."""
    if header is None:
        return None
    try:
        value = float(header.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def cached_tokens_of(usage: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field; vLLM fills it when
    started with ``--enable-prompt-tokens-details``), or None when absent or not a count."""
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def refit_cap(message: str) -> int | None:
    """The output cap that fits, from vLLM's 400 for a ``max_tokens`` past the context
    ("maximum context length is C tokens … P in the messages" / "… has P input tokens"):
    ``C - P``, or None when the message is not that or no output token fits."""
    ctx, inp = _CONTEXT.search(message), _INPUT.search(message)
    if ctx is None or inp is None:
        return None
    cap = int(ctx.group(1)) - int(inp.group(1))
    return cap if cap >= 1 else None


@dataclass(frozen=True)
class VllmConfig:
    endpoint: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str  # the served model name
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 120.0  # longest silence between two chunks
    request_timeout_s: float = 900.0  # whole request
    # extra attempts after a connection failure, or an answer of 429 / 503 (rate limited,
    # overloaded: a provider's endpoint says so before any token)
    retries: int = 3
    backoff_s: float = 0.2  # first retry delay; doubles each time
    # the longest wait a 429/503's Retry-After may ask for before a retry; a longer one
    # ends the query as an error Result at once (its deadline would pass waiting)
    max_retry_after_s: float = 30.0
    max_connections: int = 256
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token
    max_output_tokens: int | None = None  # cap sent when a query sets none (the ledger's bound)
    # the liveness probe (GET ``probe_path`` at each heartbeat): no answer within this is "down"
    health_timeout_s: float = 1.0
    # vLLM answers /health; a provider's endpoint has none, and /v1/models answers there
    probe_path: str = "/health"
    # read the engine's counts from GET /metrics at each heartbeat (vLLM); a provider has none
    read_metrics: bool = True


def request_body(
    query: Query, model: str, default_max_tokens: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body for ``query`` (always streaming, usage requested, n=1)."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name in _PASS_COMMON:
        value = getattr(query, name)
        if value is not None:
            body[name] = value
    if query.kind == "chat":
        assert query.messages is not None
        body["messages"] = [m.model_dump(exclude_none=True) for m in query.messages]
        for name in _PASS_CHAT:
            value = getattr(query, name)
            if value is not None:
                body[name] = value
        if query.logprobs is not None:
            body["logprobs"] = bool(query.logprobs)
        if query.max_completion_tokens is not None:
            body["max_completion_tokens"] = query.max_completion_tokens
        if query.max_tokens is not None:
            body["max_tokens"] = query.max_tokens
        elif query.max_completion_tokens is None and default_max_tokens is not None:
            body["max_tokens"] = default_max_tokens
        return "/v1/chat/completions", body
    body["prompt"] = query.prompt
    for name in _PASS_COMPLETION:
        value = getattr(query, name)
        if value is not None:
            body[name] = value
    cap = query.output_cap_tokens() or default_max_tokens
    if cap is not None:
        body["max_tokens"] = cap
    return "/v1/completions", body


def parse_engine_load(text: str) -> EngineLoad:
    """Running and waiting requests, KV usage and the prefix-cache counters from vLLM's
    Prometheus text (summed over label sets)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m and m.group(2) != "NaN":
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    running = values.get("vllm:num_requests_running")
    waiting = values.get("vllm:num_requests_waiting")
    # vLLM V0 names it gpu_cache_usage_perc, V1 kv_cache_usage_perc; both are fractions (0..1)
    kv = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc"))
    return EngineLoad(
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
        prefix_counters=parse_prefix_counters(text),
    )


class VllmBackend:
    """Streams requests to one OpenAI-compatible server."""

    name = "vllm"

    def __init__(self, config: VllmConfig) -> None:
        base = config.endpoint.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        if not base.startswith(("http://", "https://")):
            raise ValueError(
                f"vLLM endpoint must be an http:// or https:// URL, got {config.endpoint!r}"
            )
        self.config = config
        self.base_url = base
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        c = self.config
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(
                connect=c.connect_timeout_s, read=c.read_timeout_s, write=30.0, pool=None
            ),
            limits=httpx.Limits(
                max_connections=c.max_connections, max_keepalive_connections=c.max_connections
            ),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def model_problem(self) -> str | None:
        """Compare ``GET /v1/models`` with the model this worker sends."""
        if self._client is None:
            raise RuntimeError("VllmBackend.model_problem called before start()")
        try:
            resp = await self._client.get("/v1/models", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(
                f"{self.base_url}/v1/models: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code != 200:
            raise EngineUnavailable(f"{self.base_url}/v1/models: HTTP {resp.status_code}")
        try:
            served = [str(m["id"]) for m in resp.json()["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            return f"{self.base_url}/v1/models is not an OpenAI model list: {exc!r}"
        if self.config.model in served:
            return None
        return (
            f"the engine at {self.base_url} serves {served}, not {self.config.model!r}: start "
            f"it with --served-model-name {self.config.model} (or give the worker "
            "--served-model NAME)"
        )

    async def _health_problem(self) -> str | None:
        assert self._client is not None
        path, limit_s = self.config.probe_path, self.config.health_timeout_s
        try:
            resp = await self._client.get(path, timeout=limit_s)
        except httpx.TimeoutException:
            return f"{self.base_url}{path}: no answer in {limit_s:g} s"
        except httpx.HTTPError as exc:
            return f"{self.base_url}{path}: {type(exc).__name__}: {exc}"
        if resp.status_code != 200:
            return f"{self.base_url}{path}: HTTP {resp.status_code}"
        return None

    async def engine_load(self) -> EngineLoad:
        if self._client is None:
            return EngineLoad()
        problem = await self._health_problem()
        if problem is not None:
            return EngineLoad(answering=False, problem=problem)
        if not self.config.read_metrics:
            return EngineLoad()
        try:
            resp = await self._client.get("/metrics", timeout=2.0)
            if resp.status_code != 200:
                return EngineLoad()
            return parse_engine_load(resp.text)
        except httpx.HTTPError:
            return EngineLoad()

    async def generate(self, req: GenerationRequest, on_progress: ProgressFn) -> Generation:
        if self._client is None:
            raise RuntimeError("VllmBackend.generate called before start()")
        path, body = request_body(
            req.query, self.config.model, req.output_cap_tokens or self.config.max_output_tokens
        )
        sent_at = time.time()
        attempt = 0
        while True:
            attempt += 1
            state = _StreamState(
                req.prompt_tokens, chat=path.endswith("chat/completions"), on_text=req.on_text
            )
            sent_at = time.time()
            try:
                async with asyncio.timeout(self.config.request_timeout_s):
                    await self._stream(path, body, state, on_progress)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt <= self.config.retries:
                    delay = self.config.backoff_s * 2 ** (attempt - 1)
                    log.warning(
                        "query %s: cannot connect to %s (%s); retry %d/%d in %.2f s",
                        req.query.id, self.base_url, type(exc).__name__, attempt, self.config.retries, delay,
                    )  # fmt: skip
                    await asyncio.sleep(delay)
                    continue
                state.error = f"cannot connect to {self.base_url} after {attempt} attempts: {type(exc).__name__}: {exc}"
            except TimeoutError:
                state.error = f"request to {self.base_url}{path} timed out after {self.config.request_timeout_s:.0f} s"
            except httpx.TimeoutException as exc:
                state.error = f"{type(exc).__name__} from {self.base_url}{path}: no data for {self.config.read_timeout_s:.0f} s"
            except httpx.HTTPError as exc:
                state.error = (
                    f"stream from {self.base_url}{path} broke: {type(exc).__name__}: {exc}"
                )
            if state.status in _RETRY_STATUS and attempt <= self.config.retries:
                delay = self._retry_delay(state.retry_after_s, attempt)
                if delay is not None:
                    log.warning(
                        "query %s: HTTP %d from %s; retry %d/%d in %.2f s",
                        req.query.id, state.status, self.base_url, attempt, self.config.retries, delay,
                    )  # fmt: skip
                    await asyncio.sleep(delay)
                    continue
            refit = (
                refit_cap(state.error)
                if state.error is not None and state.error.startswith("HTTP 400")
                and req.query.output_cap_tokens() is None and not state.parts
                and body.get("max_tokens") is not None
                else None
            )  # fmt: skip
            if refit is not None and refit < body["max_tokens"]:
                # our prompt count was short of the engine's: the default cap it left did not
                # fit; once more with the cap the engine's own count leaves (never larger)
                log.info("query %s: output cap %d does not fit; retry with %d",
                         req.query.id, body["max_tokens"], refit)  # fmt: skip
                body = {**body, "max_tokens": refit}
                continue
            return state.result(sent_at, attempt)

    def _retry_delay(self, retry_after_s: float | None, attempt: int) -> float | None:
        """The wait before retrying a 429/503: the server's Retry-After when it gave one,
        else the backoff; None when the server asks for longer than ``max_retry_after_s``."""
        if retry_after_s is None:
            return self.config.backoff_s * 2 ** (attempt - 1)
        return retry_after_s if retry_after_s <= self.config.max_retry_after_s else None

    async def _stream(
        self, path: str, body: dict[str, Any], state: _StreamState, on_progress: ProgressFn
    ) -> None:
        assert self._client is not None
        async with self._client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                state.status = resp.status_code
                state.retry_after_s = retry_after_s(resp.headers.get("retry-after"))
                state.error = (
                    f"HTTP {resp.status_code} from {self.base_url}{path}: {error_message(raw)}"
                )
                return
            parser = SSEParser()
            async for text in resp.aiter_text():
                for payload in parser.feed(text):
                    if state.consume(payload, on_progress):
                        return
            for payload in parser.finish():
                if state.consume(payload, on_progress):
                    return
            if not state.done and state.error is None:
                state.error = f"stream from {self.base_url}{path} ended without [DONE]"


class _StreamState:
    def __init__(self, prompt_tokens: int, chat: bool, on_text: TextFn | None = None) -> None:
        self.chat = chat
        self.on_text = on_text
        self.finish_reason: str | None = None
        self.prompt_tokens = prompt_tokens
        self.parts: list[str] = []
        self.chunks = 0
        self.first_token_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.status: int | None = None  # an answer's HTTP status other than 200
        self.retry_after_s: float | None = None  # and its Retry-After, in seconds
        self.done = False

    def consume(self, payload: str, on_progress: ProgressFn) -> bool:
        """Apply one payload; True when the stream is over ([DONE] or an error)."""
        chunk = interpret(payload, self.chat)
        if chunk.done:
            self.done = True
            return True
        if chunk.error:
            self.error = chunk.error
            return True
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.text:
            if self.on_text is not None:
                self.on_text(chunk.text)
            if self.first_token_at is None:
                self.first_token_at = time.time()
            self.parts.append(chunk.text)
            self.chunks += 1
            on_progress(self.prompt_tokens, self.chunks)
        return False

    def result(self, sent_at: float, attempts: int) -> Generation:
        prompt, output, reported = self.prompt_tokens, self.chunks, False
        cached: int | None = None
        if self.usage is not None:
            try:
                prompt = int(self.usage.get("prompt_tokens", prompt))
                output = int(self.usage.get("completion_tokens", output))
                reported = True
            except (TypeError, ValueError):
                pass
            cached = cached_tokens_of(self.usage)
        return Generation(
            text="".join(self.parts),
            prompt_tokens=max(0, prompt),
            output_tokens=max(0, output),
            sent_at=sent_at,
            first_token_at=self.first_token_at,
            finished_at=time.time(),
            error=self.error,
            attempts=attempts,
            usage_reported=reported,
            finish_reason=self.finish_reason,
            cached_tokens=None if cached is None else min(cached, max(0, prompt)),
        )
