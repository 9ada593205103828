"""The gateway's HTTP handlers (aiohttp): OpenAI requests in, OpenAI responses out.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the bearer key names the tenant (401 otherwise);
2. the body becomes a ``Query`` (``schemas.openai_api.query_from_request``): a bad body
   is a 400 naming the field in ``param``; a ``model`` the cluster does not serve a 404;
3. a tenant whose budget left this period cannot pay the request's worst-case cost on
   any allowed model gets a 429 (``insufficient_quota``) before anything is produced;
4. the query is produced to ``queries`` and answered from its ``Result`` (not routed:
   503, or 429 ``insufficient_quota`` when the router gave up on it for the tenant's
   budget; the engine failed: 502; no result in ``request_timeout_s``: 504), or, with
   ``stream: true``, from the chunks its worker relays on ``relay.<gateway id>``: text
   chunks, a last chunk with the finish reason, the usage chunk when
   ``stream_options.include_usage`` is set, then ``data: [DONE]``. When relayed chunks do
   not arrive (``relay_grace_s`` after the Result), the rest of the text comes from the
   Result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.auth import AuthError, KeyRing
from gateway.metrics import GatewayMetrics
from gateway.relay import RelayReader
from schemas import BadMessage, ClusterConfig, Limits, Query, RelayChunk, Result, ResultCode
from schemas.openai_api import (
    chunk_body,
    error_body,
    finish_reason,
    query_from_request,
    response_body,
    usage,
)
from schemas.parse import decode_json

if TYPE_CHECKING:  # the Redis client loads only where a store is connected
    from state.protocols import Ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    gateway_id: str = "gateway"
    request_timeout_s: float = 600.0
    relay_grace_s: float = 2.0
    limits: Limits = Limits()


class HttpError(Exception):
    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: Any = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )

    def response(self) -> web.Response:
        return web.json_response(
            error_body(self.message, self.kind, self.param, self.code), status=self.status
        )


class Gateway:
    """Holds what every request needs: cluster, keys, Kafka client, relay, Redis, metrics."""

    def __init__(
        self,
        cluster: ClusterConfig,
        keys: KeyRing,
        config: GatewayConfig,
        client: Any,  # wiring.client.SwitchyardClient (started)
        relay: RelayReader,
        store: Ledger | None,  # for the budget pre-check (None: no pre-check)
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.cluster = cluster
        self.keys = keys
        self.config = config
        self.client = client
        self.relay = relay
        self.store = store
        self.metrics = metrics or GatewayMetrics()
        self.budgets = {t.tenant: t for t in cluster.tenants}

    @property
    def relay_topic(self) -> str:
        return self.relay.topic

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_message_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # ------------------------------------------------------------------ small routes

    async def health(self, _req: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def prometheus(self, _req: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def models(self, req: web.Request) -> web.Response:
        try:
            self.keys.tenant_for(req.headers.get("Authorization"))
        except AuthError as exc:
            return HttpError(
                401, str(exc), "invalid_request_error", code="invalid_api_key"
            ).response()
        names = [m.name for m in self.cluster.models] + sorted(self.cluster.model_groups) + ["auto"]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "switchyard"} for n in names]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, "/v1/completions")

    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, "/v1/chat/completions")

    # ------------------------------------------------------------------ one request

    async def _serve(self, req: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.monotonic()
        self.metrics.in_flight.inc()
        code = 200
        try:
            query, include_usage = await self._admit(req, endpoint)
            if query.stream:
                return await self._stream(req, query, include_usage, started)
            return await self._answer(query)
        except HttpError as exc:
            code = exc.status
            return exc.response()
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(endpoint, str(code)).inc()
            self.metrics.seconds.labels(endpoint).observe(time.monotonic() - started)

    async def _admit(self, req: web.Request, endpoint: str) -> tuple[Query, bool]:
        try:
            tenant = self.keys.tenant_for(req.headers.get("Authorization"))
        except AuthError as exc:
            raise HttpError(
                401, str(exc), "invalid_request_error", code="invalid_api_key"
            ) from None
        try:
            body = decode_json(await req.read(), self.config.limits)
        except BadMessage as exc:
            raise HttpError(400, exc.reason, "invalid_request_error") from None
        stream = isinstance(body, dict) and body.get("stream") is True
        opts = body.get("stream_options") if isinstance(body, dict) else None
        if opts is not None and not stream:
            raise HttpError(
                400,
                "stream_options is only allowed when stream is true",
                "invalid_request_error",
                "stream_options",
            )
        qid = "gw-" + uuid.uuid4().hex
        try:
            query = query_from_request(
                body,
                endpoint,
                query_id=qid,
                tenant=tenant,
                created_at=time.time(),
                relay_topic=self.relay_topic if stream else None,
                limits=self.config.limits,
            )
        except BadMessage as exc:
            reason = exc.reason.removeprefix(f"request {qid}: ")
            raise HttpError(400, reason, "invalid_request_error", exc.field) from None
        allowed = self._allowed_models(query)
        await self._check_budget(query, allowed)
        include = bool(isinstance(opts, dict) and opts.get("include_usage"))
        return query, include

    def _allowed_models(self, query: Query) -> list[str]:
        try:
            return (
                self.cluster.models_named(query.model)
                if query.model
                else [m.name for m in self.cluster.models]
            )
        except KeyError as exc:
            raise HttpError(
                404, str(exc.args[0]), "invalid_request_error", "model", "model_not_found"
            ) from None

    async def _check_budget(self, query: Query, allowed: list[str]) -> None:
        budget = self.budgets.get(query.tenant)
        if budget is None or self.store is None:
            return
        from state import StateUnavailable, period_id

        pid = period_id(time.time(), budget.period_s)
        try:
            status = await self.store.budget_status(query.tenant, pid)
        except StateUnavailable:
            return  # the router still enforces the budget
        left = budget.budget_usd - status.committed_usd
        cheapest = min(self.cluster.model(m).max_cost_usd(query) for m in allowed)
        if left < cheapest:
            raise HttpError(
                429,
                f"tenant {query.tenant!r} has {max(0.0, left):.6g} USD left of its "
                f"{budget.budget_usd:g} USD budget for this period; this request may cost up "
                f"to {cheapest:.6g} USD (lower max_tokens, or wait for the next period)",
                "insufficient_quota",
                code="budget_exceeded",
            )

    async def _submit(self, query: Query) -> None:
        try:
            await self.client.submit(query)
        except Exception as exc:  # noqa: BLE001 - Kafka unreachable: the client hears why
            log.warning("cannot produce query %s: %s", query.id, exc)
            raise HttpError(503, f"cannot reach Kafka: {exc}", "service_unavailable") from None

    async def _result(self, query: Query) -> Result:
        await self._submit(query)
        try:
            result: Result = await self.client.result(query.id, self.config.request_timeout_s)
        except TimeoutError:
            raise HttpError(
                504, f"no answer within {self.config.request_timeout_s:g} s", "timeout"
            ) from None
        return result

    async def _answer(self, query: Query) -> web.Response:
        result = await self._result(query)
        if result.error is not None:
            raise _result_error(result)
        return web.json_response(response_body(query, result, int(time.time())))

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self, req: web.Request, query: Query, include_usage: bool, started: float
    ) -> web.StreamResponse:
        queue = self.relay.open(query.id)
        try:
            await self._submit(query)
            resp = web.StreamResponse(
                status=200,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
            await resp.prepare(req)
            stream = _Stream(self, query, resp, include_usage, started)
            with contextlib.suppress(ConnectionResetError):
                await stream.run(queue)
            return resp
        finally:
            self.relay.close(query.id)


class _Stream:
    """One streamed answer: relayed chunks out as OpenAI chunks, the Result as the fallback."""

    def __init__(
        self,
        gw: Gateway,
        query: Query,
        resp: web.StreamResponse,
        include_usage: bool,
        started: float,
    ) -> None:
        self.gw, self.query, self.resp = gw, query, resp
        self.include_usage = include_usage
        self.started = started
        self.created = int(time.time())
        self.model = query.model or ""
        self.sent: list[str] = []
        self.attempt: int | None = None

    async def emit(self, obj: dict[str, Any]) -> None:
        await self.resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    async def text(self, text: str) -> None:
        if not text:
            return
        if not self.sent:
            self.gw.metrics.first_chunk_seconds.observe(time.monotonic() - self.started)
        await self.emit(chunk_body(self.query, self.created, self.model, text, first=not self.sent))
        self.sent.append(text)

    async def end(self, finish: str, usage_of: dict[str, Any]) -> None:
        if not self.sent:  # a chat stream always opens with the assistant's role
            await self.emit(chunk_body(self.query, self.created, self.model, "", first=True))
        await self.emit(chunk_body(self.query, self.created, self.model, "", finish))
        if self.include_usage:
            await self.emit(
                chunk_body(self.query, self.created, self.model, None, usage_of=usage_of)
            )
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    async def fail(self, err: HttpError) -> None:
        await self.emit(error_body(err.message, err.kind, err.param, err.code))
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()

    async def run(self, queue: asyncio.Queue[RelayChunk]) -> None:
        deadline = time.monotonic() + self.gw.config.request_timeout_s
        result_seen_at: float | None = None
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(queue.get(), 0.05)
            except TimeoutError:
                chunk = None
            if chunk is not None:
                if await self.on_chunk(chunk):
                    return
                continue
            result = self.gw.client.get(self.query.id)
            if result is None:
                continue
            result_seen_at = result_seen_at or time.monotonic()
            if (
                result.error is not None
                or time.monotonic() - result_seen_at > self.gw.config.relay_grace_s
            ):
                await self.from_result(result)
                return
        await self.fail(
            HttpError(504, f"no answer within {self.gw.config.request_timeout_s:g} s", "timeout")
        )

    async def on_chunk(self, chunk: RelayChunk) -> bool:
        """Forward one relayed chunk; True when the stream is finished."""
        if self.attempt is None:
            self.attempt = chunk.attempt
        if chunk.attempt != self.attempt:
            if self.sent:
                await self.fail(
                    HttpError(502, "the engine restarted this request mid-stream", "engine_error")
                )
                return True
            self.attempt = chunk.attempt  # an earlier attempt sent nothing: follow the new one
        self.model = chunk.model or self.model
        await self.text(chunk.text)
        if not chunk.done:
            return False
        if chunk.error is not None:
            await self.fail(HttpError(502, chunk.error, "engine_error"))
            return True
        prompt, out = chunk.prompt_tokens or 0, chunk.output_tokens or 0
        counts: dict[str, Any] = {
            "prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
        }  # fmt: skip
        if chunk.cached_tokens is not None:
            counts["prompt_tokens_details"] = {"cached_tokens": chunk.cached_tokens}
        await self.end(chunk.finish_reason or "stop", counts)
        return True

    async def from_result(self, result: Result) -> None:
        if result.error is not None:
            await self.fail(_result_error(result))
            return
        self.gw.metrics.relay_fallbacks.inc()
        self.model = result.model or self.model
        done = "".join(self.sent)
        rest = result.text[len(done) :] if result.text.startswith(done) else result.text
        await self.text(rest)
        await self.end(finish_reason(self.query, result), usage(result))


def _result_error(result: Result) -> HttpError:
    if result.code == ResultCode.INSUFFICIENT_QUOTA:  # the router gave up on it for budget
        return HttpError(429, str(result.error), "insufficient_quota", code="insufficient_quota")
    if result.code == ResultCode.SHED:  # shed under overload: the client may retry later
        return HttpError(503, str(result.error), "service_unavailable", code="shed")
    if not result.instance_id:
        return HttpError(503, str(result.error), "service_unavailable", code="not_routed")
    return HttpError(502, str(result.error), "engine_error", code="engine_error")


async def start_gateway(
    cluster: ClusterConfig,
    keys: KeyRing,
    config: GatewayConfig,
    settings: Any,
    partitions: int = 4,
) -> tuple[Gateway, Any]:
    """Connect to Kafka and Redis, create the relay topic, position both readers.

    Returns the gateway and a coroutine function that closes what was opened.
    """
    from state import StateStore, StateUnavailable
    from wiring import kafka_admin, topics
    from wiring.client import SwitchyardClient

    relay_topic = topics.relay(config.gateway_id)
    kw = settings.kafka_kwargs(client_id=f"switchyard-gateway-{config.gateway_id}")
    await kafka_admin.ensure_topics(
        kw,
        [topics.QUERIES, topics.RESULTS, relay_topic],
        partitions=partitions,
        **settings.topic_kwargs(),
    )
    client = SwitchyardClient(
        settings=settings, client_id=f"switchyard-gateway-{config.gateway_id}"
    )
    await client.start()
    relay = RelayReader(kw, relay_topic)
    await relay.start(await kafka_admin.partitions(kw, [relay_topic]))
    store = None
    try:
        store = await StateStore.connect(**settings.redis_kwargs())
    except (StateUnavailable, OSError) as exc:
        log.warning(
            "no Redis for the budget pre-check (%s); the router still enforces budgets", exc
        )
    gw = Gateway(cluster, keys, config, client, relay, store)

    async def close() -> None:
        await relay.stop()
        await client.close()
        if store is not None:
            await store.close()

    return gw, close
