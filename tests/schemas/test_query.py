"""Query parsing: good bodies accepted, each bad one rejected with one clear reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import BadMessage, Limits, Query, parse_query

GOOD = {"id": "q-1", "prompt": "What is 2+2?", "ttft_slo_ms": 500, "tenant": "acme"}


def body(**changes: object) -> bytes:
    value = {**GOOD, **changes}
    return json.dumps({k: v for k, v in value.items() if v is not ...}).encode()


def test_completion_and_chat_bodies_accepted() -> None:
    q = parse_query(body(max_tokens=64, temperature=0.2, stop=["\n"], stream=True))
    assert q.kind == "completion" and q.text() == "What is 2+2?" and q.output_cap_tokens() == 64
    chat = parse_query(
        body(
            prompt=...,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        )
    )
    assert chat.kind == "chat" and chat.text() == "be brief\nhi"
    parts = parse_query(
        body(prompt=..., messages=[{"role": "user", "content": [{"type": "text", "text": "ab"}]}])
    )
    assert parts.text() == "ab"


def test_defaults_and_token_estimate() -> None:
    q = parse_query(json.dumps({"id": "x", "prompt": "a" * 40}).encode())
    assert q.tenant == "default" and q.ttft_slo_ms == 2000.0
    assert q.estimated_prompt_tokens() == 10
    assert parse_query(body(prompt_tokens=7)).estimated_prompt_tokens() == 7


BAD_CASES: list[tuple[str, bytes, str]] = [
    ("null", b"null", "must be a JSON object"),
    ("empty", b"", "empty message"),
    ("whitespace", b"   \n", "empty message"),
    ("truncated json", b'{"id": "q1", "prompt": ', "malformed JSON"),
    ("trailing garbage", b'{"id": "q1"} x', "malformed JSON"),
    ("single quotes", b"{'id': 'q1'}", "malformed JSON"),
    ("array body", b'[{"id": "q1"}]', "must be a JSON object, got list"),
    ("string body", b'"hello"', "must be a JSON object, got str"),
    ("number body", b"42", "must be a JSON object, got int"),
    ("invalid utf-8", b'{"id": "q1", "prompt": "\xff\xfe"}', "not valid UTF-8"),
    ("lone surrogate bytes", b'{"id": "q1", "prompt": "\xed\xa0\x80"}', "not valid UTF-8"),
    ("missing id", json.dumps({"prompt": "hi"}).encode(), "id is required"),
    (
        "missing prompt and messages",
        json.dumps({"id": "q1"}).encode(),
        "exactly one of prompt or messages",
    ),
    (
        "both prompt and messages",
        body(messages=[{"role": "user", "content": "x"}]),
        "exactly one of prompt or messages",
    ),
    ("negative slo", body(ttft_slo_ms=-5), "ttft_slo_ms must be > 0, got -5"),
    ("zero slo", body(ttft_slo_ms=0), "ttft_slo_ms must be > 0, got 0"),
    ("absurd slo", body(ttft_slo_ms=1e12), "ttft_slo_ms must be <= 3600000"),
    ("slo as text", body(ttft_slo_ms="fast"), "ttft_slo_ms must be a number"),
    ("slo as list", body(ttft_slo_ms=[1]), "ttft_slo_ms must be a number"),
    (
        "slo NaN",
        b'{"id": "q1", "prompt": "x", "ttft_slo_ms": NaN}',
        "ttft_slo_ms must be a finite number",
    ),
    (
        "slo Infinity",
        b'{"id": "q1", "prompt": "x", "ttft_slo_ms": Infinity}',
        "ttft_slo_ms must be a finite number",
    ),
    ("id as number", body(id=17), "id must be a string"),
    ("id empty", body(id=""), "id must match"),
    ("id with spaces", body(id="a b"), "id must match"),
    ("id too long", body(id="a" * 200), "id must match"),
    ("prompt as number", body(prompt=12), "prompt"),
    ("prompt as object", body(prompt={"a": 1}), "prompt"),
    ("max_tokens zero", body(max_tokens=0), "max_tokens must be >= 1, got 0"),
    ("max_tokens negative", body(max_tokens=-3), "max_tokens must be >= 1, got -3"),
    ("max_tokens fraction", body(max_tokens=1.5), "max_tokens must be a whole number"),
    ("max_tokens text", body(max_tokens="ten"), "max_tokens must be an integer"),
    ("temperature too hot", body(temperature=9), "temperature must be <= 2, got 9"),
    ("top_p zero", body(top_p=0), "top_p must be > 0"),
    ("negative prompt_tokens", body(prompt_tokens=-1), "prompt_tokens must be >= 0, got -1"),
    ("unknown field", body(ttft_slo=5), "ttft_slo is not a known field"),
    ("tenant with slash", body(tenant="a/b"), "tenant must match"),
    (
        "bad role",
        body(prompt=..., messages=[{"role": "robot", "content": "x"}]),
        "messages[0].role must be one of",
    ),
    ("empty messages", body(prompt=..., messages=[]), "messages must have at least 1 items"),
    ("message not object", body(prompt=..., messages=["hi"]), "messages[0] must be an object"),
    ("created_at negative", body(created_at=-1), "created_at must be >= 0"),
    ("stream not bool", body(stream="yes please"), "stream must be a boolean"),
]


@pytest.mark.parametrize(("name", "raw", "expected"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_gives_one_clear_error(name: str, raw: bytes, expected: str) -> None:
    with pytest.raises(BadMessage) as info:
        parse_query(raw)
    assert expected in info.value.reason, info.value.reason
    assert "\n" not in info.value.reason


def test_at_least_thirty_bad_cases() -> None:
    assert len(BAD_CASES) >= 30


def test_size_caps_are_configurable() -> None:
    limits = Limits(max_message_bytes=200, max_prompt_bytes=50)
    with pytest.raises(BadMessage, match="over the cap of 200 bytes"):
        parse_query(body(prompt="x" * 300), limits)
    with pytest.raises(BadMessage, match="prompt is 60 bytes, over the cap of 50 bytes"):
        parse_query(body(prompt="y" * 60), limits)
    assert parse_query(body(prompt="z" * 40), limits).text() == "z" * 40


def test_deep_nesting_rejected_without_recursion_error() -> None:
    deep = b'{"id": "q1", "prompt": "x", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(BadMessage, match="nested deeper than"):
        parse_query(deep)
    very_deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(BadMessage):
        parse_query(very_deep, Limits(max_message_bytes=10_000_000))


def test_error_names_query_id() -> None:
    with pytest.raises(BadMessage, match=r"^query q-1: ttft_slo_ms must be > 0, got -5$"):
        parse_query(body(ttft_slo_ms=-5))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_but_badmessage(raw: bytes) -> None:
    try:
        parse_query(raw)
    except BadMessage as exc:
        assert exc.reason


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(list(Query.model_fields)), json_values, max_size=8))
def test_arbitrary_field_values_never_raise_anything_but_badmessage(
    value: dict[str, object],
) -> None:
    try:
        q = parse_query(json.dumps(value).encode())
    except BadMessage as exc:
        assert exc.reason
    else:
        assert q.ttft_slo_ms > 0


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.text(st.characters(exclude_categories=()), max_size=50)
    | st.text(st.characters(max_codepoint=127), max_size=50),
    chat=st.booleans(),
)
def test_memoised_text_measures_are_the_text_s(prompt: str, chat: bool) -> None:
    """``text_size_bytes`` and ``prefix_blocks`` as measured from ``text()`` itself, lone
    surrogates included (ASCII counted by its length); a copy with a new text re-measures."""
    fields = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    q = Query.model_validate({"id": "m", **fields})
    assert q.text_size_bytes == len(q.text().encode("utf-8", "surrogatepass"))
    assert (
        q.prefix_blocks() == q.prefix_blocks() == (list(q.text_prefix_hashes), q.prefix_identity[1])
    )
    copy = q.model_copy(update={"prompt": prompt + "é", "messages": None})
    assert copy.text_size_bytes == len(copy.text().encode("utf-8", "surrogatepass"))
    assert copy.prefix_identity[0] == copy.text_prefix_hashes
