"""An OpenAI-compatible HTTP server over the simulated engine: vLLM's API without a GPU.

``switchyard fake-vllm`` serves ``/v1/completions`` and ``/v1/chat/completions`` (streaming
SSE and non-streaming), ``/v1/models``, ``/health`` and ``/metrics`` (vLLM's gauge names
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:gpu_cache_usage_perc``
and token counters, and the prefix-cache counters ``vllm:prefix_cache_queries_total`` /
``_hits_total``), with the simulated engine (``RealtimeEngine``) deciding when every token
appears. Prefix caching (on unless the scheduler config turns it off, like vLLM's
``--enable-prefix-caching``): a prompt's text is cut into blocks as the router derives them
(``schemas.prefix.text_block_hashes``), and the engine prefills only what its cache lacks. Output lengths come from ``max_tokens`` or a seeded draw (``workers.synth``).

Used by the tests and the demo so that the ``vllm`` worker backend talks to a real HTTP
server with vLLM's streaming behaviour: a first chat chunk carrying the role, one token per
chunk, a final usage chunk when ``stream_options.include_usage`` is set, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from schemas import SchedulerConfig
from schemas.prefix import text_block_hashes, text_block_tokens
from workers import synth
from workers.realtime import RealtimeEngine, StreamEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FakeVllmConfig:
    model: str = "sim-model"
    max_model_len: int = 32_768
    mean_output_tokens: float = 128.0
    error_rate: float = 0.0  # fraction of requests answered with HTTP 500 (seeded)
    honour_include_usage: bool = True  # False: behave like servers that ignore stream_options
    # usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details, which
    # switchyard's own launcher always sets): the prompt tokens the prefix cache served
    prompt_tokens_details: bool = True
    seed: int = 0


class BadRequest(ValueError):
    pass


def _prompt_tokens_of(prompt: Any) -> tuple[int, str]:
    """(token count, text) of an OpenAI ``prompt``: a string, strings, or token ids."""
    if isinstance(prompt, str):
        return max(1, math.ceil(len(prompt.encode("utf-8", "surrogatepass")) / 4)), prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return len(prompt), " ".join(map(str, prompt))
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise BadRequest(
                    "this server serves one prompt per request (n prompts in a list are not supported)"
                )
            return _prompt_tokens_of(prompt[0])
    raise BadRequest("prompt must be a string, a list of one string, or a list of token ids")


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
    return "\n".join(parts)


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadRequest(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class FakeVllm:
    """The server's state: one simulated engine and its counters."""

    def __init__(self, engine: RealtimeEngine, config: FakeVllmConfig) -> None:
        self.engine = engine
        self.config = config
        self._rng = random.Random(config.seed)
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._running = Gauge(
            "vllm:num_requests_running",
            "Requests running on the engine",
            labels,
            registry=self.registry,
        )
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting", labels, registry=self.registry
        )
        self._kv = Gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage (1 = full)", labels, registry=self.registry
        )
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefilled prompt tokens", labels, registry=self.registry
        )
        # vLLM's prefix-cache counters (prompt tokens looked up / found cached), from the
        # simulated engine's own prefix cache (the prompt text's blocks: schemas.prefix)
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens", labels,
            registry=self.registry,
        )  # fmt: skip
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens", labels,
            registry=self.registry,
        )  # fmt: skip
        self._prefix_seen = (0, 0)
        self._gen_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", labels, registry=self.registry
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished requests",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.requests_total = 0

    # ---- routes ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        await self.engine.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.engine.stop()

    async def health(self, _req: web.Request) -> web.Response:
        if self.engine.failure is not None:
            return web.Response(status=503, text=f"engine failed: {self.engine.failure!r}")
        return web.Response(status=200)

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "switchyard-fake-vllm",
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )

    async def metrics(self, _req: web.Request) -> web.Response:
        m = self.config.model
        self._running.labels(m).set(self.engine.n_running)
        self._waiting.labels(m).set(self.engine.n_waiting)
        self._kv.labels(m).set(self.engine.kv_usage())
        cache = self.engine.engine.prefix_cache
        q0, h0 = self._prefix_seen
        self._prefix_queries.labels(m).inc(max(0, cache.queries - q0))
        self._prefix_hits.labels(m).inc(max(0, cache.hits - h0))
        self._prefix_seen = (cache.queries, cache.hits)
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def _usage(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
        }
        if self.config.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, chat=False)

    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        return await self._serve(req, chat=True)

    # ---- the request -----------------------------------------------------------------
    async def _serve(self, req: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await req.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        try:
            parsed = self._parse(body, chat)
        except BadRequest as exc:
            return _error(400, str(exc))
        model = body.get("model")
        if model is not None and model != self.config.model:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        self.requests_total += 1
        if self.config.error_rate > 0 and self._rng.random() < self.config.error_rate:
            return _error(
                500, "injected engine failure (fake-vllm error_rate)", "InternalServerError"
            )
        prompt_tokens, n_out, max_tokens, seed_text, stream, include_usage, text = parsed
        hashes: list[int] | None = None
        block_tokens = 512.0
        if self.engine.engine.sched.prefix_caching:
            hashes = text_block_hashes(text)
            block_tokens = text_block_tokens(
                len(text.encode("utf-8", "surrogatepass")), prompt_tokens
            )
        events = self.engine.submit(prompt_tokens, n_out, n_out, None, hashes, block_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        finish_reason = "length" if max_tokens is not None and n_out >= max_tokens else "stop"
        if stream:
            return await self._stream(
                req, events, rid, chat, seed_text, prompt_tokens, finish_reason, include_usage
            )
        tokens = cached = 0
        async for ev in events:
            tokens, cached = ev.tokens, ev.cached_tokens
        self._count(prompt_tokens, tokens, finish_reason)
        text = synth.tokens_text(seed_text, 0, tokens)
        usage = self._usage(prompt_tokens, tokens, cached)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.config.model,
                "choices": [choice],
                "usage": usage,
            }
        )

    def _parse(
        self, body: dict[str, Any], chat: bool
    ) -> tuple[int, int, int | None, str, bool, bool, str]:
        if chat:
            if "messages" not in body:
                raise BadRequest("messages is required")
            text = _messages_text(body["messages"])
            prompt_tokens = max(1, math.ceil(len(text.encode("utf-8", "surrogatepass")) / 4))
        else:
            if "prompt" not in body:
                raise BadRequest("prompt is required")
            prompt_tokens, text = _prompt_tokens_of(body["prompt"])
        max_tokens = _int_field(body, "max_completion_tokens", 1) if chat else None
        max_tokens = max_tokens or _int_field(body, "max_tokens", 1)
        n = _int_field(body, "n", 1)
        if n is not None and n != 1:
            raise BadRequest(f"n must be 1 on this server, got {n}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream must be a boolean, got {stream!r}")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest("stream_options must be an object")
        if opts and not stream:
            raise BadRequest("stream_options can only be set if stream is true")
        include_usage = bool(opts.get("include_usage")) and self.config.honour_include_usage
        seed = body.get("seed")
        seed_text = f"{seed}\x1f{text}" if seed is not None else text
        n_out = synth.output_tokens(max_tokens, seed_text, self.config.mean_output_tokens)
        if max_tokens is None:
            n_out = min(n_out, max(1, self.config.max_model_len - prompt_tokens))
        if prompt_tokens + n_out > self.config.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + n_out} tokens ({prompt_tokens} in the messages, {n_out} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        return prompt_tokens, n_out, max_tokens, seed_text, stream, include_usage, text

    async def _stream(
        self,
        req: web.Request,
        events: Any,
        rid: str,
        chat: bool,
        seed_text: str,
        prompt_tokens: int,
        finish_reason: str,
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(req)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = 0

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            payload: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.config.model,
                "choices": [choice] if choice is not None else [],
            }
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        try:
            ev: StreamEvent
            async for ev in events:
                target = ev.tokens
                buf = bytearray()
                while sent < target:
                    if chat and sent == 0:
                        role = {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                        buf += chunk(role)
                    text = synth.token_text(seed_text, sent)
                    sent += 1
                    last = ev.kind == "finished" and sent == target
                    fr = finish_reason if last else None
                    if chat:
                        buf += chunk(
                            {
                                "index": 0,
                                "delta": {"content": text},
                                "logprobs": None,
                                "finish_reason": fr,
                            }
                        )
                    else:
                        buf += chunk(
                            {"index": 0, "text": text, "logprobs": None, "finish_reason": fr}
                        )
                if buf:
                    await resp.write(bytes(buf))
            self._count(prompt_tokens, sent, finish_reason)
            if include_usage:
                await resp.write(chunk(None, self._usage(prompt_tokens, sent, ev.cached_tokens)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client went away during %s after %d tokens", rid, sent)
            raise
        return resp

    def _count(self, prompt_tokens: int, tokens: int, finish_reason: str) -> None:
        m = self.config.model
        self._prompt_tokens.labels(m).inc(prompt_tokens)
        self._gen_tokens.labels(m).inc(tokens)
        self._success.labels(m, finish_reason).inc()


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    return web.json_response(
        {
            "error": {"message": message, "type": kind, "param": None, "code": status},
            "object": "error",
        },
        status=status,
    )


def build_server(
    *,
    profile: str | None = None,
    coefficients: Any = None,
    scheduler: SchedulerConfig | None = None,
    time_scale: float = 1.0,
    config: FakeVllmConfig | None = None,
    noise_sigma: float = 0.0,
) -> FakeVllm:
    """A server over a fresh simulated engine (``profile`` tables or Eq. 9 ``coefficients``)."""
    from workers.realtime import make_timing

    cfg = config or FakeVllmConfig()
    timing = make_timing(profile=profile, coefficients=coefficients, noise_sigma=noise_sigma)
    engine = RealtimeEngine(
        timing,
        scheduler or SchedulerConfig(),
        time_scale=time_scale,
        seed=cfg.seed,
        model=cfg.model,
    )
    return FakeVllm(engine, cfg)


class RunningServer:
    """A server started inside the current event loop (tests, demo); ``await stop()`` ends it."""

    def __init__(self, server: FakeVllm, runner: web.AppRunner, host: str, port: int) -> None:
        self.server = server
        self.runner = runner
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_server(server: FakeVllm, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Listen on ``host:port`` (0: a free port, reported in ``RunningServer.port``)."""
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    if port == 0:
        server_obj = site._server  # aiohttp exposes the bound port only through the asyncio server
        assert server_obj is not None and hasattr(server_obj, "sockets")
        bound = int(server_obj.sockets[0].getsockname()[1])
    return RunningServer(server, runner, host, bound)
