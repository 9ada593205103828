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


# ---- conditional_output_tokens: residents' remaining output, given what they decoded ----------

from routing.length import conditional_output_tokens  # noqa: E402

# eight finished lengths, summing to 210
FIN = np.array([2, 4, 6, 8, 10, 30, 50, 100])


def test_a_decoding_resident_is_predicted_the_mean_of_the_finished_lengths_above_it() -> None:
    d = np.array([1, 5, 10, 29])
    got = conditional_output_tokens(d, np.full(4, 20), FIN, min_finished=8, min_tail=3)
    # d=1: all eight, 210/8 = 26.25; d=5: 6+8+10+30+50+100 = 204 over 6 = 34;
    # d=10 and d=29: 30, 50, 100 -> 60 (three left: min_tail still met)
    np.testing.assert_array_equal(got, [26, 34, 60, 60])
    # a resident's own prediction of a longer output stays: max(own, mean(L | L > d))
    own = conditional_output_tokens(d, np.array([40, 20, 90, 20]), FIN, min_finished=8)
    np.testing.assert_array_equal(own, [40, 34, 90, 60])


def test_beyond_the_last_min_tail_lengths_the_tail_is_memoryless() -> None:
    # fewer than 3 lengths above d: t* = 30 - 1 = 29 (the largest d with 30, 50, 100 above
    # it), mean residual life there e0 = 60 - 29 = 31, so d + 31
    d = np.array([30, 40, 100, 200])
    got = conditional_output_tokens(d, np.full(4, 20), FIN, min_finished=8, min_tail=3)
    np.testing.assert_array_equal(got, [61, 71, 131, 231])


def test_nothing_decoded_or_too_few_finished_keeps_the_own_prediction_never_below_d_plus_1() -> None:
    # d=0: the routed prediction (20), whatever finished
    got = conditional_output_tokens(np.array([0, 0]), np.array([20, 1]), FIN, min_finished=8)
    np.testing.assert_array_equal(got, [20, 1])
    # seven finished (< 8): every resident keeps max(own, d + 1)
    few = conditional_output_tokens(
        np.array([0, 5, 40]), np.array([20, 20, 20]), FIN[:7], min_finished=8
    )
    np.testing.assert_array_equal(few, [20, 20, 41])
    # zero-length rows are not lengths: with them dropped only seven remain
    with_zeros = np.concatenate([FIN[:7], [0, 0]])
    np.testing.assert_array_equal(
        conditional_output_tokens(np.array([5]), np.array([20]), with_zeros, min_finished=8), [20]
    )
    empty = conditional_output_tokens(np.zeros(0, np.int64), np.zeros(0, np.int64), FIN)
    assert empty.shape == (0,)


def test_conditional_prediction_grows_with_decoded_and_stays_above_it() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        fin = rng.geometric(rng.uniform(0.005, 0.2), rng.integers(8, 40))
        d = np.arange(0, int(fin.max()) + 50)
        got = conditional_output_tokens(d, np.ones_like(d), fin)
        assert (got[1:] >= d[1:] + 1).all()
        assert (np.diff(got[1:]) >= 0).all()  # E[L | L > d] never falls as d grows


def test_conditional_output_tokens_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="shape"):
        conditional_output_tokens(np.array([1, 2]), np.array([3]), FIN)
    with pytest.raises(ValueError, match="min_finished and min_tail"):
        conditional_output_tokens(np.array([1]), np.array([3]), FIN, min_tail=0)
