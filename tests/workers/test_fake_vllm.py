"""The fake vLLM server over HTTP, and the vLLM backend against it: OpenAI streaming format,
usage or counted chunks, errors with readable messages, engine gauges, the CLI process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from schemas import Query, StepTimeCoefficients
from switchyard.services import free_port
from wiring.sse import SSEParser
from workers.backends.base import GenerationRequest
from workers.backends.vllm import VllmBackend, VllmConfig
from workers.fake_vllm import FakeVllmConfig, RunningServer, build_server, start_server

COEF = StepTimeCoefficients(
    c0_ms=2.0, c1_ms_per_token=0.01, c2_ms_per_ctx_token=0.0, c3_ms_per_attn_unit=0.0
)


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    s = await start_server(
        build_server(
            coefficients=COEF, time_scale=4.0, config=FakeVllmConfig(model="m", max_model_len=4096)
        )
    )
    yield s
    await s.stop()


@contextlib.asynccontextmanager
async def _endpoint(**routes: Any) -> AsyncIterator[str]:
    """A hand-written server on a free loopback port: ``post_<path>`` / ``get_<path>``
    handlers (the path's slashes as ``__``); yields its base URL."""
    app = web.Application()
    for key, handler in routes.items():
        method, path = key.split("_", 1)
        app.router.add_route(method.upper(), "/" + path.replace("__", "/"), handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _req(q: Query) -> GenerationRequest:
    return GenerationRequest(
        q, q.id + ".1", q.estimated_prompt_tokens(), q.output_cap_tokens() or 16
    )


async def test_streaming_completion_format(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "model": "m",
                "prompt": "abc " * 50,
                "max_tokens": 7,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = SSEParser().feed(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
    assert len(texts) == 7 and all(t.startswith(" ") for t in texts)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 50,
        "completion_tokens": 7,
        "total_tokens": 57,
        "prompt_tokens_details": {"cached_tokens": 0},  # as vLLM's --enable-prompt-tokens-details
    }


async def test_prefix_cache_hits_are_reported_in_usage_and_read_by_the_backend(
    server: RunningServer,
) -> None:
    """The second of two prompts sharing a 4 KiB head finds it cached: the usage chunk says
    how many prompt tokens (``prompt_tokens_details.cached_tokens``), and the backend's
    ``Generation.cached_tokens`` carries it to the worker, which bills them at the cached
    price."""
    head = f"[{server.url}] " + "the same long context again " * 150
    backend = VllmBackend(VllmConfig(endpoint=server.url, model="m"))
    await backend.start()
    try:
        got = [
            await backend.generate(
                _req(Query(id=f"c{i}", prompt=head + tail, max_tokens=2)), lambda p, d: None
            )
            for i, tail in enumerate(("first question", "second question"))
        ]
    finally:
        await backend.close()
    assert all(g.error is None for g in got)
    assert got[0].cached_tokens == 0
    assert got[1].cached_tokens is not None and 0.5 * got[1].prompt_tokens < got[1].cached_tokens
    assert got[1].cached_tokens < got[1].prompt_tokens


async def test_non_streaming_chat_and_models(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hey"}], "max_tokens": 4},
        )
        models = (await c.get("/v1/models")).json()
        health = await c.get("/health")
    body = r.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    assert (
        body["choices"][0]["message"]["role"] == "assistant"
        and len(body["choices"][0]["message"]["content"].split()) == 4
    )
    assert models["data"][0]["id"] == "m" and health.status_code == 200


async def test_bad_requests_get_openai_errors(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as c:
        cases = [
            (await c.post("/v1/completions", content=b"{nope"), 400, "not valid JSON"),
            (await c.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt is required"),
            (
                await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}),
                400,
                "max_tokens must be an integer >= 1",
            ),
            (
                await c.post("/v1/completions", json={"prompt": "x", "model": "other"}),
                404,
                "The model `other` does not exist",
            ),
            (
                await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000}),
                400,
                "maximum context length is 4096",
            ),
            (
                await c.post("/v1/chat/completions", json={"messages": []}),
                400,
                "messages must be a non-empty list",
            ),
        ]
    for resp, status, text in cases:
        assert resp.status_code == status
        assert text in resp.json()["error"]["message"]


async def test_backend_ttft_usage_and_gauges_while_running() -> None:
    # a slow engine (half real speed): the six requests are all resident for a while
    server = await start_server(
        build_server(coefficients=COEF, time_scale=0.5, config=FakeVllmConfig(model="m"))
    )
    backend = VllmBackend(VllmConfig(endpoint=server.url + "/v1", model="m"))
    await backend.start()
    engine = server.server.engine
    try:
        qs = [Query(id=f"q{i}", prompt="word " * 400, max_tokens=200) for i in range(6)]
        progress: dict[str, list[tuple[int, int]]] = {q.id: [] for q in qs}
        tasks = [
            asyncio.create_task(
                backend.generate(_req(q), lambda p, d, k=q.id: progress[k].append((p, d)))
            )
            for q in qs
        ]
        async with asyncio.timeout(10):
            while engine.n_running + engine.n_waiting < 6:
                await asyncio.sleep(0.005)
        load = await backend.engine_load()
        gens = await asyncio.gather(*tasks)
    finally:
        await backend.close()
        await server.stop()
    assert (
        load.running is not None and load.waiting is not None and load.running + load.waiting == 6
    )
    for q, g in zip(qs, gens, strict=True):
        assert (
            g.error is None
            and g.usage_reported
            and g.output_tokens == 200
            and g.prompt_tokens == 500
        )
        assert g.first_token_at is not None and g.sent_at < g.first_token_at <= g.finished_at
        assert [d for _, d in progress[q.id]] == list(range(1, 201))  # one progress call per token


async def test_backend_counts_chunks_when_usage_is_ignored() -> None:
    srv = await start_server(
        build_server(
            coefficients=COEF,
            time_scale=4.0,
            config=FakeVllmConfig(model="m", honour_include_usage=False),
        )
    )
    backend = VllmBackend(VllmConfig(endpoint=srv.url, model="m"))
    await backend.start()
    try:
        g = await backend.generate(
            _req(Query(id="c", messages=[{"role": "user", "content": "hi"}], max_tokens=9)),
            lambda p, d: None,
        )
    finally:
        await backend.close()
        await srv.stop()
    assert (
        g.error is None
        and not g.usage_reported
        and g.output_tokens == 9
        and len(g.text.split()) == 9
    )


async def test_backend_http_errors_and_broken_streams_become_errors(server: RunningServer) -> None:
    backend = VllmBackend(VllmConfig(endpoint=server.url, model="not-served"))
    await backend.start()
    try:
        g = await backend.generate(_req(Query(id="e", prompt="x", max_tokens=3)), lambda p, d: None)
    finally:
        await backend.close()
    assert g.error is not None and g.error.startswith(
        f"HTTP 404 from {server.url}/v1/completions: The model `not-served`"
    )

    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":" a"}]}\n\n')
        return resp  # ends without [DONE]

    async def fails(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "engine died"}}, status=500)

    async with _endpoint(post_v1__completions=broken, post_v1__chat__completions=fails) as url:
        backend = VllmBackend(VllmConfig(endpoint=url, model="m"))
        await backend.start()
        try:
            g1 = await backend.generate(
                _req(Query(id="b", prompt="x", max_tokens=3)), lambda p, d: None
            )
            g2 = await backend.generate(
                _req(Query(id="f", messages=[{"role": "user", "content": "x"}])),
                lambda p, d: None,
            )
        finally:
            await backend.close()
    assert (
        g1.error is not None
        and "ended without [DONE]" in g1.error
        and g1.text == " a"
        and g1.output_tokens == 1
    )
    assert g2.error == f"HTTP 500 from {url}/v1/chat/completions: engine died"


def test_fake_vllm_command_serves_until_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "switchyard.cli",
            "fake-vllm",
            "--coefficients",
            "2,0.01,0,0",
            "--port",
            str(port),
            "--model",
            "m",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"fake-vllm serving m on http://127.0.0.1:{port}" in line
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            timeout=10,
        )
        assert r.json()["usage"]["completion_tokens"] == 2
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'vllm:num_requests_running{model_name="m"} 0.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)  # by pid: the process this test started
        assert proc.wait(timeout=15) == 0


def test_fake_vllm_command_rejects_missing_timing() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard.cli", "fake-vllm", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "give --profile NAME, --coefficients" in proc.stderr


async def test_model_check_names_what_the_engine_serves(server: RunningServer) -> None:
    from workers.backends.base import EngineUnavailable

    ok = VllmBackend(VllmConfig(endpoint=server.url, model="m"))
    other = VllmBackend(VllmConfig(endpoint=server.url, model="qwen"))
    gone = VllmBackend(VllmConfig(endpoint=f"http://127.0.0.1:{free_port()}", model="m"))
    for b in (ok, other, gone):
        await b.start()
    try:
        assert await ok.model_problem() is None
        problem = await other.model_problem()
        with pytest.raises(EngineUnavailable):
            await gone.model_problem()
    finally:
        for b in (ok, other, gone):
            await b.close()
    assert problem and "serves ['m'], not 'qwen'" in problem, problem


async def test_engine_load_is_not_answering_once_the_server_is_gone() -> None:
    s = await start_server(build_server(coefficients=COEF, config=FakeVllmConfig(model="m")))
    backend = VllmBackend(VllmConfig(endpoint=s.url, model="m", health_timeout_s=0.5))
    await backend.start()
    try:
        up = await backend.engine_load()
        await s.stop()
        down = await backend.engine_load()
    finally:
        await backend.close()
    assert up.answering and up.running == 0
    assert not down.answering and down.problem and "/health" in down.problem


async def test_a_frozen_engine_fails_the_probe_within_its_timeout() -> None:
    async def hang(_req: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.Response(text="late")

    async with _endpoint(get_health=hang) as url:
        backend = VllmBackend(VllmConfig(endpoint=url, model="m", health_timeout_s=0.3))
        await backend.start()
        try:
            async with asyncio.timeout(2.0):
                load = await backend.engine_load()
        finally:
            await backend.close()
    assert not load.answering and load.problem and "no answer in 0.3 s" in load.problem


async def test_a_worker_whose_engine_serves_another_model_refuses_to_start(
    server: RunningServer,
) -> None:
    """Before any topic or heartbeat: WorkerFatal naming the served and the expected model."""
    from typing import Any, cast

    from schemas import ClusterConfig
    from wiring.settings import Settings
    from workers.worker import Worker, WorkerConfig, WorkerFatal

    cfg = ClusterConfig.model_validate(
        {"models": [{"name": "qwen", "input_usd_per_token": 0, "output_usd_per_token": 0}],
         "instances": [{"id": "qwen-0", "model": "qwen", "endpoint": server.url}]}
    )  # fmt: skip
    backend = VllmBackend(VllmConfig(endpoint=server.url, model="qwen"))
    state = cast(Any, object())  # never touched: the worker stops before Redis
    w = Worker(WorkerConfig(instance_id="qwen-0"), cfg, backend,
               Settings(kafka="127.0.0.1:1", redis="redis://127.0.0.1:1"), state)  # fmt: skip
    with pytest.raises(WorkerFatal) as got:
        async with asyncio.timeout(10):
            await w.run(asyncio.Event())
    assert "refuses to start" in str(got.value) and "serves ['m'], not 'qwen'" in str(got.value)
    assert w.counts["results"] == 0 and not w.started.is_set()


async def test_a_default_cap_the_engine_refuses_is_retried_with_the_cap_that_fits(
    server: RunningServer,
) -> None:
    """Our prompt count short of the engine's: the default cap overflows max_model_len (400);
    one retry with the cap the engine's own count leaves answers it. An own max_tokens that
    does not fit stays an error (the engine's message)."""
    backend = VllmBackend(VllmConfig(endpoint=server.url, model="m"))
    await backend.start()
    q = Query(id="q", prompt="word " * 400)  # 500 tokens for the fake engine
    own = Query(id="own", prompt="word " * 400, max_tokens=4000)
    try:
        short = GenerationRequest(q, "q.1", 100, 16, output_cap_tokens=4096)
        got = await backend.generate(short, lambda p, d: None)
        refused = await backend.generate(_req(own), lambda p, d: None)
    finally:
        await backend.close()
    assert got.error is None and got.attempts == 2 and got.output_tokens > 0, got
    assert refused.error and "HTTP 400" in refused.error and "maximum context length" in refused.error


async def test_a_worker_waits_for_an_engine_that_is_slow_to_start() -> None:
    from typing import Any, cast

    from schemas import ClusterConfig
    from wiring.settings import Settings
    from workers.worker import Worker, WorkerConfig

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = ClusterConfig.model_validate(
        {"models": [{"name": "m", "input_usd_per_token": 0, "output_usd_per_token": 0}],
         "instances": [{"id": "m-0", "model": "m", "endpoint": url}]}
    )  # fmt: skip
    backend = VllmBackend(VllmConfig(endpoint=url, model="m"))
    w = Worker(WorkerConfig(instance_id="m-0"), cfg, backend,
               Settings(kafka="127.0.0.1:1", redis="redis://127.0.0.1:1"), cast(Any, object()))  # fmt: skip
    await backend.start()
    waiting = asyncio.create_task(w._engine_ready(asyncio.Event()))
    await asyncio.sleep(1.5)
    assert not waiting.done()  # no engine yet: no heartbeat, no consuming
    s = await start_server(build_server(coefficients=COEF, config=FakeVllmConfig(model="m")),
                           port=port)  # fmt: skip
    try:
        async with asyncio.timeout(10):
            assert await waiting
    finally:
        await backend.close()
        await s.stop()
    assert not w._engine_lost


async def test_rate_limited_and_overloaded_answers_are_retried_after_their_retry_after(
    server: RunningServer,
) -> None:
    """A provider's 429 / 503 refuses before any work: retried after its Retry-After (or the
    backoff), up to ``retries``; then, or when Retry-After asks too much, an error naming it."""
    asked: list[float] = []

    def limited(status: int, refusals: int, retry_after: str | None) -> web.RequestHandler:
        async def handler(request: web.Request) -> web.StreamResponse:
            asked.append(asyncio.get_running_loop().time())
            if len(asked) <= refusals:
                headers = {} if retry_after is None else {"Retry-After": retry_after}
                return web.json_response(
                    {"error": {"message": "slow down"}}, status=status, headers=headers
                )
            async with httpx.AsyncClient(base_url=server.url) as c:  # then the real answer
                r = await c.post("/v1/completions", json=await request.json())
            return web.Response(body=r.content, content_type="text/event-stream")

        return handler

    async def run(
        handler: web.RequestHandler, retries: int = 3
    ) -> tuple[str | None, int, list[float]]:
        asked.clear()
        async with _endpoint(post_v1__completions=handler) as url:
            cfg = VllmConfig(endpoint=url, model="m", retries=retries, backoff_s=0.05,
                             max_retry_after_s=1.0)  # fmt: skip
            backend = VllmBackend(cfg)
            await backend.start()
            try:
                g = await backend.generate(
                    _req(Query(id="r", prompt="x", max_tokens=3)), lambda p, d: None
                )
            finally:
                await backend.close()
        return g.error, g.attempts, [b - a for a, b in itertools.pairwise(asked)]

    error, attempts, gaps = await run(limited(429, 2, "0.3"))
    assert error is None and attempts == 3
    assert all(0.3 <= gap < 1.0 for gap in gaps), gaps  # Retry-After honoured
    error, attempts, gaps = await run(limited(503, 1, None))
    assert error is None and attempts == 2 and 0.05 <= gaps[0] < 1.0  # the backoff
    error, attempts, _ = await run(limited(429, 9, "0"), retries=2)
    assert attempts == 3 and error is not None and error.startswith("HTTP 429 from ")
    assert error.endswith("slow down")
    error, attempts, _ = await run(limited(429, 9, "120"))  # longer than it may wait
    assert attempts == 1 and error is not None and "HTTP 429" in error
    error, attempts, _ = await run(limited(500, 9, "0"))  # may have done the work: no retry
    assert attempts == 1 and error is not None and "HTTP 500" in error


async def test_a_cloud_models_worker_talks_to_a_provider_with_its_key(
    server: RunningServer,
) -> None:
    """A provider's OpenAI-compatible endpoint: a bearer key (SWITCHYARD_ENGINE_API_KEY), no
    /health and no /metrics. The worker's backend for a ``cloud`` model probes /v1/models,
    reads no engine counts and sends the key; without the key it is told why."""
    from schemas import ClusterConfig
    from switchyard.commands.worker import _backend
    from wiring.settings import Settings

    seen: list[str] = []

    def authorised(request: web.Request) -> web.Response | None:
        seen.append(f"{request.method} {request.path}")
        if request.headers.get("Authorization") != "Bearer sk-test":
            return web.json_response({"error": {"message": "Incorrect API key"}}, status=401)
        return None

    async def models(request: web.Request) -> web.Response:
        return authorised(request) or web.json_response(
            {"object": "list", "data": [{"id": "gpt-x", "object": "model"}]}
        )

    async def completions(request: web.Request) -> web.Response:
        refused = authorised(request)
        if refused is not None:
            return refused
        body = await request.json()
        async with httpx.AsyncClient(base_url=server.url) as c:  # the answer of a real engine
            r = await c.post("/v1/completions", json={**body, "model": "m"})
        return web.Response(body=r.content, content_type="text/event-stream")

    async def missing(request: web.Request) -> web.Response:  # a provider has neither
        seen.append(f"{request.method} {request.path}")
        return web.json_response({"error": {"message": "not found"}}, status=404)

    async with _endpoint(get_v1__models=models, post_v1__completions=completions,
                         get_health=missing, get_metrics=missing) as url:  # fmt: skip
        cfg = ClusterConfig.model_validate(
            {
                "models": [
                    {"name": "gpt-x", "kind": "cloud", "input_usd_per_token": 1e-6,
                     "output_usd_per_token": 2e-6},
                    {"name": "m", "input_usd_per_token": 0, "output_usd_per_token": 0},
                ],
                "instances": [{"id": "gpt-x-0", "model": "gpt-x", "endpoint": url},
                              {"id": "m-0", "model": "m", "endpoint": url}],
            }
        )  # fmt: skip

        async def worker_backend(
            instance: str, settings: Settings
        ) -> tuple[Any, str | None, Any, Any]:
            be = _backend("vllm", cfg, instance, cfg.model_of(instance), None, None, 1.0, 0,
                          None, 1.0, settings)  # fmt: skip
            await be.start()
            try:
                load = await be.engine_load()
                problem = None if not load.answering else await be.model_problem()
                g = await be.generate(
                    _req(Query(id="k", prompt="x", max_tokens=3)), lambda p, d: None
                )
            finally:
                await be.close()
            return load, problem, g, be.config

        keyed = Settings.from_env({"SWITCHYARD_ENGINE_API_KEY": "sk-test"})
        load, problem, g, config = await worker_backend("gpt-x-0", keyed)
        assert load.answering and load.running is None and problem is None
        assert g.error is None and g.output_tokens == 3
        assert "GET /health" not in seen and "GET /metrics" not in seen
        assert "sk-test" not in repr(config) and "sk-test" not in repr(keyed)

        load, _, g, _ = await worker_backend("gpt-x-0", Settings.from_env({}))
        assert not load.answering and load.problem == f"{url}/v1/models: HTTP 401"
        assert g.error == f"HTTP 401 from {url}/v1/completions: Incorrect API key"

        seen.clear()  # a local model's worker still asks vLLM's /health
        load, _, _, _ = await worker_backend("m-0", keyed)
        assert seen[0] == "GET /health" and load.problem == f"{url}/health: HTTP 404"
