"""``ModelSpec.max_costs_usd``: a window's worst cases as one array, each the very float
``ModelSpec.max_cost_usd`` gives (the budget reservation sends them to the ledger)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import ModelSpec, Query

_PRICE = st.floats(min_value=0.0, max_value=1e-3, allow_nan=False)


def _query(i: int, text: str, chat: bool, prompt_tokens: int | None, cap: int | None) -> Query:
    body: dict[str, object] = {"id": f"q{i}", "prompt_tokens": prompt_tokens, "max_tokens": cap}
    if chat:
        body["messages"] = [{"role": "user", "content": text}, {"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return Query.model_validate(body)


@settings(max_examples=300, deadline=None)
@given(
    prices=st.tuples(_PRICE, _PRICE, st.none() | _PRICE),
    max_output=st.integers(1, 1_000_000),
    max_model_len=st.none() | st.integers(1, 200_000),
    kv_blocks=st.integers(1, 10**9),
    queries=st.lists(
        st.tuples(
            st.text(st.characters(codec="utf-8"), max_size=300),
            st.booleans(),
            st.none() | st.integers(0, 10_000_000),
            st.none() | st.integers(1, 1_000_000),
        ),
        max_size=12,
    ),
)
def test_each_is_max_cost_usd(
    prices: tuple[float, float, float | None],
    max_output: int,
    max_model_len: int | None,
    kv_blocks: int,
    queries: list[tuple[str, bool, int | None, int | None]],
) -> None:
    inp, out, cached = prices
    spec = ModelSpec.model_validate(
        {
            "name": "m",
            "input_usd_per_token": inp,
            "output_usd_per_token": out,
            "cached_input_usd_per_token": None if cached is None else min(cached, inp),
            "max_output_tokens": max_output,
            "max_model_len": max_model_len,
            "scheduler": {"kv_blocks": kv_blocks},
        }
    )
    qs = [_query(i, *q) for i, q in enumerate(queries)]
    got = spec.max_costs_usd(qs)
    assert got.shape == (len(qs),)
    assert got.tolist() == [spec.max_cost_usd(q) for q in qs]  # the same floats, exactly
