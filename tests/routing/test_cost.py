"""Cost model (routing/cost.py)."""

from __future__ import annotations

import numpy as np
import pytest

from routing.cost import cost_usd, estimate_prompt_tokens


def test_cost_formula_known_answer() -> None:
    prompt = np.array([100, 10], dtype=np.int64)
    out = np.array([[50.0, 0.0], [1.0, 2.0]])
    pin = np.array([1e-6, 2e-6])
    pout = np.array([4e-6, 8e-6])
    got = cost_usd(prompt, out, pin, pout)
    np.testing.assert_allclose(got, [[100e-6 + 200e-6, 200e-6], [10e-6 + 4e-6, 20e-6 + 16e-6]])


def test_cost_shape_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"output_tokens must be \[n, m\] = \[2, 2\]"):
        cost_usd(np.array([1, 2]), np.zeros((2, 3)), np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match="prompt_tokens must be 1-D"):
        cost_usd(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros(2), np.zeros(2))


def test_prompt_token_estimate() -> None:
    got = estimate_prompt_tokens(["a" * 40, "汉字汉字", ""], np.array([0, 0, 8]))
    assert got.tolist() == [10, 4, 2]
