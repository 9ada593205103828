"""Hostile input at the parsing level: every bad message is a ``BadMessage`` with a reason.

The same strategies feed scenario 6 (``test_hostile_stream.py``) through the real router;
here they run against ``schemas.parse_query`` alone, so a gap is found in milliseconds.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import (
    LIMITS,
    Hostile,
    deeply_nested,
    huge_prompts,
    invalid_utf8,
    lone_surrogates,
    long_integers,
    oversized_messages,
    parse_bad_messages,
    pool,
    valid_query_dicts,
)

from schemas import BadMessage, DeadLetter, parse_query

pytestmark = pytest.mark.faults

MAX_REASON_CHARS = 1_000  # a reason is a line for humans, never a copy of the message


def _reject(msg: Hostile) -> str:
    try:
        query = parse_query(msg.raw, LIMITS)
    except BadMessage as exc:
        return exc.reason
    except Exception as exc:  # anything else would crash a router that catches BadMessage only
        pytest.fail(
            f"{msg.kind}: parse_query raised {type(exc).__name__} instead of BadMessage: "
            f"{str(exc)[:200]} (raw starts {msg.raw[:120]!r})"
            if msg.raw is not None
            else f"{msg.kind}: {exc!r}"
        )
    pytest.fail(f"{msg.kind}: accepted a hostile message as {query!r:.200} (raw {msg.raw!r:.200})")


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # huge reprs
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parse_bad_messages(include_huge=False))
def test_every_bad_message_is_rejected_with_a_reason(msg: Hostile) -> None:
    reason = _reject(msg)
    assert reason.strip(), f"{msg.kind}: empty reason"
    assert len(reason) <= MAX_REASON_CHARS, f"{msg.kind}: reason of {len(reason)} chars"
    raw = msg.raw or b""
    letter = DeadLetter.of(raw, reason, "queries", 0, 7, 1.0)
    again = DeadLetter.model_validate_json(letter.model_dump_json())
    assert again.reason == reason
    # kept whole when small; a large one keeps a prefix, its size and its SHA-256 (the whole
    # message stays at its source offset), so a dead letter always fits in the broker
    assert raw.startswith(again.raw()) and (again.raw() == raw or again.truncated)
    assert again.raw_size_bytes == len(raw)
    assert again.raw_sha256 == hashlib.sha256(raw).hexdigest()


@settings(max_examples=100, deadline=None)
@given(valid_query_dicts())
def test_valid_queries_parse_and_serialise(body: dict[str, object]) -> None:
    raw = json.dumps(body).encode()
    query = parse_query(raw, LIMITS)
    assert query.id == body["id"]
    # the router re-serialises every query it routes: that must never fail
    assert parse_query(query.model_dump_json().encode(), LIMITS) == query


@pytest.mark.parametrize(
    "strategy",
    [lone_surrogates(), long_integers(), deeply_nested(), invalid_utf8()],
    ids=["lone_surrogate", "long_integer", "deep_json", "invalid_utf8"],
)
def test_sharp_edges(strategy: st.SearchStrategy[Hostile]) -> None:
    """Families that once slipped past the parser (see docs/reliability.md, "bugs found")."""
    for msg in pool(strategy, 60):
        _reject(msg)


def test_huge_and_oversized_messages() -> None:
    for msg in pool(huge_prompts(), 8) + pool(oversized_messages(), 3):
        reason = _reject(msg)
        assert "over the cap" in reason, reason
        assert len(reason) <= MAX_REASON_CHARS


def test_pool_is_deterministic_and_varied() -> None:
    a = pool(parse_bad_messages(include_huge=False), 300)
    b = pool(parse_bad_messages(include_huge=False), 300)
    assert [m.raw for m in a] == [m.raw for m in b]
    kinds = {m.kind for m in a}
    assert len(kinds) >= 10, f"only {sorted(kinds)} drawn"
