"""Output-length predictor (routing/length.py)."""

from __future__ import annotations

import numpy as np
import pytest

from routing.length import LengthPredictor


def test_untrained_default_is_per_model_constant() -> None:
    lp = LengthPredictor(["a", "b"], [100.0, 300.0])
    got = lp.predict(["x", "y", "z"], np.array([5, 50, 500]))
    np.testing.assert_array_equal(got, [[100, 300]] * 3)
    with pytest.raises(ValueError, match="default_tokens must be finite and > 0"):
        LengthPredictor(["a"], 0.0)


def test_fit_recovers_length_that_grows_with_prompt() -> None:
    rng = np.random.default_rng(0)
    n = 400
    prompt = rng.integers(10, 2000, n)
    X = rng.normal(size=(n, 3)).astype(np.float32)
    true_a = 2.0 * prompt  # model a echoes, about twice the prompt
    true_b = np.full(n, 50.0)  # model b answers briefly
    noise = np.exp(rng.normal(0, 0.1, (n, 2)))
    out = np.column_stack([true_a, true_b]) * noise
    out[:, 1][rng.random(n) < 0.5] = np.nan  # half of b's lengths unknown
    lp = LengthPredictor(["a", "b", "c"], 256.0).fit(
        np.column_stack([out, np.full(n, np.nan)]), prompt, X
    )
    pred = lp.predict_features(prompt, X)
    rel = np.abs(pred[:, :2] - np.column_stack([true_a, true_b])) / np.column_stack(
        [true_a, true_b]
    )
    assert np.median(rel) < 0.05
    np.testing.assert_array_equal(pred[:, 2], 256.0)  # no data for c: keeps the prior
    params, arrays = lp.state()
    again = LengthPredictor.from_state(params, arrays)
    np.testing.assert_array_equal(again.predict_features(prompt, X), pred)
