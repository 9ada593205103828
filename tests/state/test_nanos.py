"""``state.redis_core.usd_to_nanos``: a window's reservation amounts in nano-USD as one
array, each the very integer ``usd_to_nano`` gives, and its errors where one is wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from state.redis_core import MAX_LEDGER_NANO, NANO_PER_USD, usd_to_nano, usd_to_nanos

_USD = st.floats(min_value=0.0, max_value=MAX_LEDGER_NANO / NANO_PER_USD, allow_nan=False)
_TINY = st.floats(min_value=0.0, max_value=1e-6, allow_nan=False)  # around the rounding


@settings(max_examples=400, deadline=None)
@given(usds=st.lists(_USD | _TINY | st.integers(0, 1000) | st.just(-0.0), max_size=20))
def test_each_is_usd_to_nano(usds: list[float]) -> None:
    ids = [f"q{i}" for i in range(len(usds))]
    try:
        want: list[int] | str = [
            usd_to_nano(u, "amount", q) for u, q in zip(usds, ids, strict=True)
        ]
    except ValueError as exc:  # the cap, right at its edge
        want = str(exc)
    try:
        got: list[int] | str = usd_to_nanos(usds, "amount", ids)
    except ValueError as exc:
        got = str(exc)
    assert got == want
    assert isinstance(got, str) or all(type(n) is int for n in got)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-12, 1e12])
def test_a_bad_amount_is_named_as_usd_to_nano_names_it(bad: float) -> None:
    with pytest.raises(ValueError) as want:
        usd_to_nano(bad, "amount", "q2")
    with pytest.raises(ValueError) as got:
        usd_to_nanos([0.5, 1e-3, bad, 2.0], "amount", ["q0", "q1", "q2", "q3"])
    assert str(got.value) == str(want.value)
