"""``parse_query``'s fast path (pydantic's JSON parser) accepts exactly what the full path
accepts, with the same query, and leaves every refusal to the full path's message."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import BadMessage, Limits, Query, parse_query
from schemas.parse import _fast_query, parse_model

LIMITS = Limits()


def _full(raw: bytes, limits: Limits = LIMITS) -> Query | str:
    try:
        return parse_model(Query, raw, limits, "query")
    except BadMessage as exc:
        return exc.reason


def _check(raw: bytes, limits: Limits = LIMITS) -> None:
    full = _full(raw, limits)
    fast = _fast_query(raw, limits)
    if fast is not None:
        assert isinstance(full, Query), (raw, full)
        assert fast == full and fast.model_dump() == full.model_dump(), raw
    try:
        got: Query | str = parse_query(raw, limits)
    except BadMessage as exc:
        got = exc.reason
    assert got == full, raw


EDGE = [
    b'{"id":"a","prompt":"hello"}',
    b'  {"id":"a","prompt":"hello"}\n',
    b'\xef\xbb\xbf{"id":"a","prompt":"hello"}',  # BOM
    b'{"id":"a","prompt":"hello"} x',  # trailing data
    b'{"id":"a","prompt":"hello"}{}',
    b'{"id":"a","id":"b","prompt":"hello"}',  # duplicate key
    b'{"id":"a","prompt":"one","prompt":"two"}',
    b'{"id":"a","prompt":"x","ttft_slo_ms":NaN}',
    b'{"id":"a","prompt":"x","ttft_slo_ms":Infinity}',
    b'{"id":"a","prompt":"x","ttft_slo_ms":1e999}',
    b'{"id":"a","prompt":"x","ttft_slo_ms":"150"}',
    b'{"id":"a","prompt":"x","max_tokens":5.0}',
    b'{"id":"a","prompt":"x","max_tokens":5.5}',
    b'{"id":"a","prompt":"x","max_tokens":"7"}',
    b'{"id":"a","prompt":"x","max_tokens":true}',
    b'{"id":"a","prompt":"x","seed":123456789012345678901234567890}',
    b'{"id":"a","prompt":"x","logprobs":1}',
    b'{"id":"a","prompt":"x","logprobs":true}',
    b'{"id":"a","prompt":"x","stream_options":{"a":[1,2.5,{"b":null}]}}',
    b'{"id":"a","prompt":"x","metadata":{"k":1}}',
    b'{"id":"a","prompt":["x","y"]}',
    b'{"id":"a","messages":[{"role":"user","content":"hi"}]}',
    b'{"id":"a","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}',
    b'{"id":"a","prompt":"caf\\u00e9"}',
    b'{"id":"a","prompt":"\\ud800"}',  # lone surrogate
    b'{"id":"a","prompt":"\xff"}',  # not UTF-8
    b'{"id":"a","prompt":"x","extra":1}',
    b'{"id":"a"}',
    b'{"id":"a","prompt":"x","messages":[{"role":"user"}]}',
    b"[]",
    b"null",
    b"",
    b"   ",
    b'"str"',
    b'{"id":"a","prompt":"x","stream_options":' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}",
    b'{"id":"a","prompt":"x","tools":[' + b"[" * 29 + b"]" * 29 + b"]}",
    b'{"id":"a","prompt":"x","tools":[' + b"[" * 30 + b"]" * 30 + b"]}",
    b'{"id":"a","prompt":"' + b"y" * 600_000 + b'"}',  # over the prompt cap
]


@pytest.mark.parametrize("raw", EDGE, ids=range(len(EDGE)))
def test_edge_cases_agree(raw: bytes) -> None:
    _check(raw)


def test_fast_path_is_taken_for_an_ordinary_query() -> None:
    raw = b'{"id":"q-1","prompt":"route me","ttft_slo_ms":500,"max_tokens":64}'
    assert _fast_query(raw, LIMITS) is not None


def test_limits_are_the_callers() -> None:
    raw = b'{"id":"a","prompt":"' + b"y" * 200 + b'"}'
    _check(raw, Limits(max_prompt_bytes=100))
    _check(raw, Limits(max_message_bytes=100))
    _check(b'{"id":"a","prompt":"x","tools":[[[]]]}', Limits(max_json_depth=3))


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = [
    "id", "tenant", "ttft_slo_ms", "prompt_tokens", "created_at", "task", "prefix_hashes",
    "prefix_block_tokens", "model", "prompt", "messages", "max_tokens", "temperature", "top_p",
    "stop", "stream", "stream_options", "seed", "logit_bias", "logprobs", "top_logprobs",
    "top_k", "metadata", "tool_choice", "user",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6),
    st.sampled_from(["q-1", "bad id!", 7]),
    st.sampled_from(["text", ["a", "b"], None]),
)
def test_random_bodies_agree(body: dict[str, Any], qid: Any, prompt: Any) -> None:
    body = {"id": qid, "prompt": prompt, **body}
    _check(json.dumps(body).encode())
    _check(json.dumps(body, ensure_ascii=False).encode())


def test_decision_bytes_equal_pydantic_json() -> None:
    from schemas import Decision, DecisionFlag, DecisionStatus, WindowStats, decision_bytes

    stats = WindowStats(
        window_id='p:1.5:q "1"', n_queries=2, solver="fast", objective=1.0, lp_bound=1.0,
        gap=0.0, budget_usd=1.0, spend_usd=0.5, decide_ms=3.0,
    )  # fmt: skip
    other = stats.model_copy(update={"window_id": "p:2:q"})
    common = {"tenant": "t", "policy": "p", "decided_at": 5.0}
    decisions = [
        Decision(query_id="a", status=DecisionStatus.ROUTED, instance_id="i-0", window=stats,
                 flags=[DecisionFlag.LPS_ESTIMATE], predicted_cost_usd=1e-7, **common),
        Decision(query_id="b", status=DecisionStatus.DEFERRED, reason='no "slot" – café',
                 window=stats, **common),
        Decision(query_id="c", status=DecisionStatus.ROUTED, instance_id="i-1", window=other,
                 **common),
        Decision(query_id="d", status=DecisionStatus.REJECTED, **common),
    ]  # fmt: skip
    windows: dict[int, bytes] = {}
    for d in decisions:
        assert decision_bytes(d, windows) == d.model_dump_json(exclude_none=True).encode()
    assert len(windows) == 2
