"""Hypothesis strategies of hostile messages for the ``queries`` topic.

Each strategy draws a :class:`Hostile` — the raw bytes a producer could put on the wire and
the family of badness it belongs to. Families (issue 8, scenario 6):

* parse-level — every one must be rejected by ``schemas.parse_query`` with a ``BadMessage``
  (and so land in ``dead-letters`` with a reason): wrong types, missing fields, both or
  neither of prompt/messages, out-of-range values, huge prompts, oversized messages,
  invalid UTF-8, lone UTF-16 surrogates, integers too long to parse, deeply nested JSON,
  negative / zero / NaN / infinite / absurd SLOs, malformed JSON, non-object JSON, empty
  bodies and null (tombstone) values;
* semantic — well-formed queries the router must still refuse: duplicate ids with
  different bodies (``duplicate_id_pairs``) and unknown tenants (``unknown_tenant_queries``).

``pool(strategy, n)`` draws ``n`` examples deterministically (no example database, no
shrinking), so a 100,000-message stream is built from a few thousand distinct drawings.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from schemas import Limits

LIMITS = Limits()
BROKER_MAX_VALUE_BYTES = 1_000_000  # what a default Kafka broker / producer accepts, with margin

# fields of a Query and the JSON kinds that can never be coerced into them
_STRING_FIELDS = ("id", "tenant", "task", "model", "suffix", "user")
_NUMBER_FIELDS = (
    "ttft_slo_ms",
    "prompt_tokens",
    "created_at",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "top_logprobs",
)
_OBJECT_FIELDS = ("response_format", "metadata")
_LIST_FIELDS = ("messages", "tools")


@dataclass(frozen=True)
class Hostile:
    """One hostile message: ``raw`` is the Kafka value (None is a tombstone)."""

    raw: bytes | None
    kind: str
    kafka_ok: bool = True  # False: larger than a default broker accepts (parse-level only)


# --------------------------------------------------------------------------- building blocks

safe_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40
)
_ALNUM = string.ascii_letters + string.digits
query_ids = st.text(alphabet=_ALNUM + "_.:-", min_size=1, max_size=40)
tenants = st.text(alphabet=_ALNUM + "_.-", min_size=1, max_size=24)


@st.composite
def valid_query_dicts(draw: st.DrawFn, id_prefix: str = "") -> dict[str, Any]:
    """A query body ``parse_query`` accepts (completion or chat)."""
    body: dict[str, Any] = {"id": id_prefix + draw(query_ids)}
    if draw(st.booleans()):
        body["prompt"] = draw(safe_text)
    else:
        body["messages"] = [{"role": "user", "content": draw(safe_text)}]
    if draw(st.booleans()):
        body["ttft_slo_ms"] = draw(st.floats(min_value=1, max_value=60_000))
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(min_value=1, max_value=512))
    return body


def _dump(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8")


non_numeric_json = st.one_of(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz !?", min_size=1, max_size=12).filter(
        lambda s: not _looks_numeric(s)
    ),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from("abc"), st.integers(), max_size=2),
)
non_string_json = st.one_of(
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from("abc"), st.integers(), max_size=2),
)


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return s.strip().lower() in ("inf", "nan", "infinity")
    return True


# --------------------------------------------------------------------------- parse-level families


@st.composite
def wrong_types(draw: st.DrawFn) -> Hostile:
    body = draw(valid_query_dicts())
    family = draw(st.sampled_from(("string", "number", "object", "list", "prompt")))
    if family == "string":
        body[draw(st.sampled_from(_STRING_FIELDS))] = draw(non_string_json)
    elif family == "number":
        body[draw(st.sampled_from(_NUMBER_FIELDS))] = draw(non_numeric_json)
    elif family == "object":
        body[draw(st.sampled_from(_OBJECT_FIELDS))] = draw(
            st.one_of(st.integers(), st.lists(st.integers(), min_size=1, max_size=3), safe_text)
        )
    elif family == "list":
        body.pop("prompt", None)
        body[draw(st.sampled_from(_LIST_FIELDS))] = draw(st.one_of(st.integers(), safe_text))
        body.setdefault("messages", "not a list")
    else:
        body.pop("messages", None)
        body["prompt"] = draw(
            st.one_of(
                st.integers(),
                st.dictionaries(st.sampled_from("xyz"), st.integers(), min_size=1),
                st.lists(st.integers(), min_size=1, max_size=3),
            )
        )
    return Hostile(_dump(body), "wrong_type")


@st.composite
def missing_fields(draw: st.DrawFn) -> Hostile:
    body = draw(valid_query_dicts())
    if draw(st.booleans()):
        del body["id"]
    else:
        body.pop("prompt", None)
        body.pop("messages", None)
    return Hostile(_dump(body), "missing_field")


@st.composite
def conflicting_or_out_of_range(draw: st.DrawFn) -> Hostile:
    body = draw(valid_query_dicts())
    choice = draw(st.integers(min_value=0, max_value=11))
    if choice == 0:
        body["prompt"], body["messages"] = "p", [{"role": "user", "content": "m"}]
    elif choice == 1:
        body.pop("prompt", None)
        body["messages"] = []
    elif choice == 2:
        body.pop("prompt", None)
        body["messages"] = [{"role": draw(st.sampled_from(("robot", "", "USER"))), "content": "x"}]
    elif choice == 3:
        body["max_tokens"] = draw(st.integers(max_value=0))
    elif choice == 4:
        body["temperature"] = draw(st.floats(min_value=2.001, max_value=1e6))
    elif choice == 5:
        body["prompt_tokens"] = draw(st.integers(max_value=-1))
    elif choice == 6:
        body["id"] = draw(
            st.one_of(
                st.just(""),
                st.text(alphabet="abc def/#?", min_size=1, max_size=20).filter(
                    lambda s: any(c in s for c in " /#?")
                ),
                st.just("x" * 129),
            )
        )
    elif choice == 7:
        body["tenant"] = draw(st.sampled_from(("", "acme corp", "t" * 65, "../etc", "tenant\n")))
    elif choice == 8:
        body[draw(st.sampled_from(("routing_hint", "api_key", "__proto__", "Id")))] = "x"
    elif choice == 9:
        body["n"] = draw(st.sampled_from((0, 129, -1)))
    elif choice == 10:
        body["created_at"] = draw(st.sampled_from((-1.0, 1e12, 1e300)))
    else:
        body["top_p"] = draw(st.sampled_from((0, 1.5, -0.1)))
    return Hostile(_dump(body), "out_of_range")


@st.composite
def bad_slos(draw: st.DrawFn) -> Hostile:
    """Negative, zero, over an hour, NaN, ±Infinity and overflowing SLOs."""
    qid = draw(query_ids)
    literal = draw(
        st.one_of(
            st.floats(max_value=0, allow_nan=False, allow_infinity=False).map(repr),
            st.floats(min_value=3_600_000.5, allow_nan=False, allow_infinity=False).map(repr),
            st.integers(max_value=0).map(str),
            st.sampled_from(("NaN", "Infinity", "-Infinity", "1e400", "-1e400")),
        )
    )
    return Hostile(
        f'{{"id": "{qid}", "prompt": "hi", "ttft_slo_ms": {literal}}}'.encode(), "bad_slo"
    )


@st.composite
def huge_prompts(draw: st.DrawFn) -> Hostile:
    """A prompt over ``max_prompt_bytes`` (still a message Kafka accepts)."""
    over = draw(
        st.integers(min_value=1, max_value=BROKER_MAX_VALUE_BYTES - LIMITS.max_prompt_bytes)
    )
    size = LIMITS.max_prompt_bytes + over
    filler = draw(st.sampled_from(("a", "é", "字")))  # 1, 2 and 3 bytes per character
    n = math.ceil(size / len(filler.encode()))
    body: dict[str, Any] = {"id": draw(query_ids)}
    text = filler * n
    if (
        len(json.dumps({**body, "prompt": text}, ensure_ascii=False).encode())
        > BROKER_MAX_VALUE_BYTES
    ):
        text = "a" * (LIMITS.max_prompt_bytes + 1)
    if draw(st.booleans()):
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return Hostile(json.dumps(body, ensure_ascii=False).encode("utf-8"), "huge_prompt")


@st.composite
def oversized_messages(draw: st.DrawFn) -> Hostile:
    """Over ``max_message_bytes``: rejected before JSON decoding (too big for Kafka's defaults)."""
    over = draw(st.integers(min_value=1, max_value=4096))
    pad = "a" * (LIMITS.max_message_bytes + over)
    return Hostile(f'{{"id": "big", "prompt": "{pad}"}}'.encode(), "oversized", kafka_ok=False)


_INVALID_UTF8 = (
    b"\xff",
    b"\xfe\xff",
    b"\xc3\x28",  # broken two-byte sequence
    b"\xc0\xaf",  # overlong '/'
    b"\xed\xa0\x80",  # CESU-8 surrogate
    b"\xf8\x88\x80\x80\x80",  # five-byte form
    b"\xe2\x82",  # truncated three-byte
    b"\x80",  # lone continuation byte
)


@st.composite
def invalid_utf8(draw: st.DrawFn) -> Hostile:
    bad = draw(st.sampled_from(_INVALID_UTF8))
    where = draw(st.sampled_from(("prompt", "id", "key", "raw")))
    qid = draw(query_ids).encode()
    if where == "prompt":
        raw = b'{"id": "' + qid + b'", "prompt": "ok' + bad + b'ok"}'
    elif where == "id":
        raw = b'{"id": "' + qid + bad + b'", "prompt": "hi"}'
    elif where == "key":
        raw = b'{"id": "' + qid + b'", "prompt": "hi", "k' + bad + b'": 1}'
    else:
        noise = draw(st.binary(min_size=0, max_size=64))
        raw = noise + bad + noise
    return Hostile(raw, "invalid_utf8")


@st.composite
def lone_surrogates(draw: st.DrawFn) -> Hostile:
    """Valid JSON whose string escapes a lone UTF-16 surrogate: not encodable as UTF-8."""
    code = draw(st.integers(min_value=0xD800, max_value=0xDFFF))
    qid = draw(query_ids)
    field = draw(st.sampled_from(("prompt", "content", "stop")))
    esc = f"\\u{code:04x}"
    if field == "prompt":
        raw = f'{{"id": "{qid}", "prompt": "a{esc}b"}}'
    elif field == "content":
        raw = f'{{"id": "{qid}", "messages": [{{"role": "user", "content": "{esc}"}}]}}'
    else:
        raw = f'{{"id": "{qid}", "prompt": "hi", "stop": "{esc}"}}'
    return Hostile(raw.encode(), "lone_surrogate")


@st.composite
def long_integers(draw: st.DrawFn, max_digits: int = 20_000) -> Hostile:
    """Integer literals past Python's 4,300-digit int-parsing limit."""
    digits = draw(st.integers(min_value=4_301, max_value=max(4_301, max_digits)))
    field = draw(st.sampled_from(("seed", "ttft_slo_ms", "max_tokens", "n")))
    raw = '{"id": "q-long", "prompt": "hi", "' + field + '": ' + "9" * digits + "}"
    return Hostile(raw.encode(), "long_integer")


@st.composite
def deeply_nested(draw: st.DrawFn, max_depth: int = 100_000) -> Hostile:
    depth = draw(
        st.one_of(
            st.integers(min_value=LIMITS.max_json_depth + 1, max_value=200),
            st.integers(min_value=1_000, max_value=max(1_000, max_depth)),
        )
    )
    opener, closer = draw(st.sampled_from((("[", "]"), ('{"a":', "}"))))
    inner = opener * depth + "1" + closer * depth
    if draw(st.booleans()):
        raw = inner
    else:
        field = draw(st.sampled_from(("metadata", "response_format", "tools", "prompt")))
        raw = f'{{"id": "{draw(query_ids)}", "prompt": "hi", "{field}": {inner}}}'
        if field == "prompt":
            raw = f'{{"id": "{draw(query_ids)}", "prompt": {inner}}}'
    return Hostile(raw.encode(), "deep_json")


@st.composite
def malformed_json(draw: st.DrawFn) -> Hostile:
    good = _dump(draw(valid_query_dicts()))
    choice = draw(st.integers(min_value=0, max_value=4))
    if choice == 0:
        cut = draw(st.integers(min_value=1, max_value=len(good) - 1))
        raw = good[:cut]
    elif choice == 1:
        raw = good + draw(st.sampled_from((b" x", b",", b"}", b"{}")))
    elif choice == 2:
        raw = good.replace(b'"', b"'")
    elif choice == 3:
        raw = good[:-1] + b",}"
    else:
        raw = draw(st.text(alphabet='{}[]:,"abc 123', min_size=1, max_size=30)).encode()
        try:
            json.loads(raw)
            raw = b"{" + raw
        except ValueError:
            pass
    return Hostile(raw, "malformed_json")


non_objects = st.one_of(
    st.integers().map(lambda v: Hostile(str(v).encode(), "non_object")),
    st.lists(st.integers(), max_size=4).map(lambda v: Hostile(_dump(v), "non_object")),
    safe_text.map(lambda v: Hostile(_dump(v), "non_object")),
    st.sampled_from((b"null", b"true", b"false", b"1.5")).map(lambda v: Hostile(v, "non_object")),
)

empties = st.sampled_from(
    (Hostile(b"", "empty"), Hostile(b"   \n\t", "empty"), Hostile(None, "tombstone"))
)


def parse_bad_messages(
    include_oversized: bool = False,
    include_huge: bool = True,
    max_depth: int = 100_000,
    max_digits: int = 20_000,
) -> st.SearchStrategy[Hostile]:
    """Every message drawn here must fail ``schemas.parse_query`` with a ``BadMessage``.

    ``max_depth`` / ``max_digits`` bound the size of the nesting and long-integer families
    (a stream of 100,000 messages keeps them to a few KiB each).
    """
    families: list[st.SearchStrategy[Hostile]] = [
        wrong_types(),
        missing_fields(),
        conflicting_or_out_of_range(),
        bad_slos(),
        invalid_utf8(),
        lone_surrogates(),
        long_integers(max_digits),
        deeply_nested(max_depth),
        malformed_json(),
        non_objects,
        empties,
    ]
    if include_huge:
        families.append(huge_prompts())
    if include_oversized:
        families.append(oversized_messages())
    return st.one_of(*families)


# --------------------------------------------------------------------------- semantic families


@st.composite
def duplicate_id_pairs(draw: st.DrawFn, id_prefix: str = "dup-") -> tuple[bytes, bytes]:
    """Two valid bodies with the same id and different contents (the second must not run)."""
    first = draw(valid_query_dicts(id_prefix=id_prefix))
    second = dict(first)
    second.pop("prompt", None)
    second.pop("messages", None)
    second["prompt"] = "different body: " + draw(safe_text)
    second["ttft_slo_ms"] = float(first.get("ttft_slo_ms", 2000.0)) + 1.0
    return _dump(first), _dump(second)


@st.composite
def unknown_tenant_queries(draw: st.DrawFn, id_prefix: str = "unk-") -> bytes:
    body = draw(valid_query_dicts(id_prefix=id_prefix))
    body["tenant"] = "unknown-" + draw(tenants)
    return _dump(body)


# --------------------------------------------------------------------------- pools


def pool(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """``n`` deterministic drawings of ``strategy`` (generate phase only, no database)."""
    out: list[Any] = []

    @settings(
        max_examples=n,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    return out
