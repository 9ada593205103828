"""SSE parsing and OpenAI chunk interpretation: chunk boundaries anywhere, every line ending."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from wiring.sse import SSEParser, error_message, interpret

STREAM = (
    ": keep-alive\n\n"
    'data: {"choices":[{"index":0,"text":" Hello"}]}\n\n'
    "event: message\n"
    'data: {"choices":[{"index":0,"text":" world","finish_reason":"length"}]}\n\n'
    'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    "data: [DONE]\n\n"
)


def _events(text: str, cuts: list[int]) -> list[str]:
    p = SSEParser()
    out: list[str] = []
    last = 0
    for c in sorted(set(cuts)):
        out += p.feed(text[last:c])
        last = c
    out += p.feed(text[last:])
    return out + p.finish()


def test_whole_stream() -> None:
    events = _events(STREAM, [])
    assert len(events) == 4 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == " Hello"


@given(
    st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20),
    st.sampled_from(["\n", "\r\n", "\r"]),
)
def test_any_chunking_and_line_ending_gives_the_same_events(cuts: list[int], eol: str) -> None:
    text = STREAM.replace("\n", eol)
    assert _events(text, [min(c, len(text)) for c in cuts]) == _events(STREAM, [])


def test_multiline_data_and_missing_final_blank_line() -> None:
    p = SSEParser()
    assert p.feed("data: a\ndata: b\n\ndata:c") == ["a\nb"]
    assert p.finish() == ["c"]


def test_interpret_completion_chat_usage_and_done() -> None:
    c = interpret('{"choices":[{"index":0,"text":"hi","finish_reason":null}]}', chat=False)
    assert (c.text, c.finish_reason, c.usage) == ("hi", None, None)
    role = interpret(
        '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', chat=True
    )
    assert role.text == "" and role.has_choice
    c = interpret(
        '{"choices":[{"index":0,"delta":{"content":" x"},"finish_reason":"stop"}]}', chat=True
    )
    assert (c.text, c.finish_reason) == (" x", "stop")
    u = interpret('{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}', chat=True)
    assert u.usage == {"prompt_tokens": 5, "completion_tokens": 7} and u.text == ""
    assert interpret("[DONE]", chat=False).done


def test_interpret_errors_name_the_problem() -> None:
    assert "server error in stream: boom" in (
        interpret('{"error":{"message":"boom"}}', chat=False).error or ""
    )
    assert "server error in stream: bad" in (
        interpret('{"object":"error","message":"bad"}', chat=False).error or ""
    )
    assert "malformed stream chunk" in (interpret("{nope", chat=False).error or "")
    assert "not a JSON object" in (interpret("[1,2]", chat=False).error or "")


def test_error_message_of_bodies() -> None:
    assert (
        error_message(b'{"error":{"message":"model x does not exist"}}') == "model x does not exist"
    )
    assert error_message(b'{"object":"error","message":"too long"}') == "too long"
    assert error_message(b"<html>502</html>") == "<html>502</html>"
    assert error_message(b"") == "(empty body)"
