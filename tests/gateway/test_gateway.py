"""``switchyard gateway`` with the official ``openai`` SDK (sync, async, streaming) against the
real service: router (registered policy, default predictor), workers, fake vLLM servers.

Checked: OpenAI responses and chunks parse in the SDK's own types; ``model`` constrains the
instance; a stream is relayed chunk by chunk, ends with usage, and says the same text as
the non-streamed answer; bad bodies are 400s naming ``param``; an unknown model a 404;
a wrong key a 401; a tenant over budget a 429 with an OpenAI error body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.auth import key_digest
from tests.frontdoor import LARGE, SMALL, Stack, stack

pytestmark = pytest.mark.integration

KEY, POOR_KEY = "sy-test-key-default", "sy-test-key-poor"
TENANTS = [
    {"tenant": "default", "budget_usd": 100.0, "api_keys_sha256": [key_digest(KEY)]},
    {"tenant": "poor", "budget_usd": 1e-9, "api_keys_sha256": [key_digest(POOR_KEY)]},
]


@pytest.fixture(scope="module")
def svc(
    kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with stack(
        tmp_path_factory.mktemp("gateway"),
        kafka_bootstrap,
        redis_url,
        tenants=TENANTS,
        gateway_args=(),
    ) as st:
        yield st


def client(svc: Stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{svc.gateway_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_and_completions_sync(svc: Stack) -> None:
    c = client(svc)
    chat = c.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Tell me about rail yards"}],
        max_tokens=8,
        temperature=0.3,
        logit_bias={"11": -5},
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert chat.model in (SMALL, LARGE)
    small = c.completions.create(model=SMALL, prompt="Say hello", max_tokens=5)
    assert small.model == SMALL and small.choices[0].text and small.usage.completion_tokens == 5  # type: ignore[union-attr]
    big = c.completions.create(model="big", prompt="Say hello", max_tokens=5)
    assert big.model == LARGE
    ids = {m.id for m in c.models.list()}
    assert {SMALL, LARGE, "big", "auto"} <= ids


async def test_streaming_async_relays_chunks_and_usage(svc: Stack) -> None:
    c = openai.AsyncOpenAI(base_url=f"{svc.gateway_url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Stream me a story about switching trains"}]
    stream = await c.chat.completions.create(
        model=SMALL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch async for ch in stream]
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(texts) > 1, "the text should arrive in several chunks"
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert not chunks[-1].choices and all(ch.model == SMALL for ch in chunks)
    # the engine's prefix-cache count, relayed (the fake engine reports it as vLLM does)
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # the same prompt without streaming says the same (the fake engine's text is seeded by it)
    whole = await c.chat.completions.create(model=SMALL, messages=messages, max_tokens=24)  # type: ignore[arg-type]
    assert "".join(texts) == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens is not None
    await c.close()


def test_streaming_completions_sync(svc: Stack) -> None:
    parts = list(client(svc).completions.create(model="auto", prompt="Once upon a time", max_tokens=12, stream=True))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert len(text.split()) == 12 and parts[-1].choices[0].finish_reason == "length"


def test_errors_are_openai_errors(svc: Stack) -> None:
    c = client(svc)
    msg = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="auto", messages=msg, n=2)  # type: ignore[arg-type]
    assert bad.value.param == "n" and "one completion" in bad.value.message  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model="auto", messages=msg, temperature=7)  # type: ignore[arg-type]
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model="gpt-4o", messages=msg)  # type: ignore[arg-type]
    assert missing.value.code == "model_not_found" and SMALL in missing.value.message
    with pytest.raises(openai.AuthenticationError):
        client(svc, key="sy-wrong").chat.completions.create(model="auto", messages=msg)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError) as poor:
        client(svc, key=POOR_KEY).chat.completions.create(model="auto", messages=msg, max_tokens=4)  # type: ignore[arg-type]
    assert poor.value.code == "budget_exceeded" and "poor" in poor.value.message
    url, auth = f"{svc.gateway_url}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    raw = httpx.post(url, headers=auth, json={"model": "auto", "prompt": "wrong endpoint"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "messages"
    raw = httpx.post(url, headers=auth, json={"messages": msg, "prompt": "both"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"
    raw = httpx.post(url, headers=auth, content=b"{not json")
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]


async def test_kafka_front_door_with_kcat(svc: Stack) -> None:
    """Queries produced by kcat (librdkafka, not our client): OpenAI fields honoured, n=2 and
    an unknown model dead-lettered with the reason, the rest answered on ``results``."""
    import json
    import uuid

    from aiokafka import AIOKafkaConsumer

    from schemas import DeadLetter, Result
    from tests.real_producers import kcat_produce
    from wiring import topics

    kafka = svc.env["SWITCHYARD_KAFKA"]
    tag = uuid.uuid4().hex[:8]
    bodies = {
        f"k{tag}-bias": {"prompt": "hello", "max_tokens": 6, "logit_bias": {"50256": -100}, "model": "big"},
        f"k{tag}-small": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "model": SMALL,
                          "top_k": 20, "min_p": 0.05},
        f"k{tag}-n2": {"prompt": "two please", "n": 2},
        f"k{tag}-gpt": {"prompt": "x", "model": "gpt-4o"},
    }  # fmt: skip
    consumer = AIOKafkaConsumer(topics.RESULTS, topics.DEAD_LETTERS, bootstrap_servers=kafka,
                                auto_offset_reset="latest", group_id=f"kcat-{tag}")  # fmt: skip
    await consumer.start()
    try:
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=200)
        for tp in consumer.assignment():
            await consumer.position(tp)
        records = [(qid.encode(), json.dumps(dict(b, id=qid)).encode()) for qid, b in bodies.items()]
        kcat_produce(kafka, topics.QUERIES, records, "zstd")
        results: dict[str, Result] = {}
        letters: list[DeadLetter] = []
        async with asyncio.timeout(90):
            while len(results) < 2 or len(letters) < 2:
                for tp, recs in (await consumer.getmany(timeout_ms=500)).items():
                    for r in recs:
                        if tp.topic == topics.RESULTS:
                            res = Result.model_validate_json(r.value)
                            if res.query_id.startswith(f"k{tag}"):
                                results[res.query_id] = res
                        else:
                            dl = DeadLetter.model_validate_json(r.value)
                            if f"k{tag}" in dl.raw().decode():
                                letters.append(dl)
    finally:
        await consumer.stop()
    assert results[f"k{tag}-bias"].error is None and results[f"k{tag}-bias"].model == LARGE
    assert results[f"k{tag}-small"].error is None and results[f"k{tag}-small"].model == SMALL
    reasons = " | ".join(dl.reason for dl in letters)
    assert "n must be 1, got 2" in reasons and "'gpt-4o' is not served" in reasons, reasons
