"""A window's quality predictions equal each query's alone, and the per-text memo returns
them (routing/quality/memo.py, knn.block_similarity), to float32 rounding: on some CPUs
OpenBLAS rounds a row of a product differently by its position in the block (seen on an AMD
EPYC with OpenBLAS 0.3.31), so bit-for-bit equality is not something BLAS guarantees."""

from __future__ import annotations

import numpy as np
import pytest

from routing.quality import QualityPredictor, train_predictor
from routing.quality.knn import SIM_BLOCK_ROWS, block_similarity
from routing.quality.memo import PredictionMemo, text_key
from tests.routing.test_quality import synthetic

pytestmark = pytest.mark.usefixtures("one_blas_thread")

# a row's similarities may differ by a few float32 ulps with its position in the block
SIM_RTOL = 1e-5
PRED_ATOL = 1e-6


@pytest.fixture(scope="module")
def knn() -> QualityPredictor:
    data, _ = synthetic(600, seed=3)
    return train_predictor(
        data, "knn", n_replicates=8, level=0.8, seed=0, estimator_kwargs={"k": 15}
    )


def _texts(n: int, seed: int) -> list[str]:
    test, _ = synthetic(n, seed=seed)
    return list(test.texts)


def _fresh(pred: QualityPredictor, memo_size: int) -> QualityPredictor:
    out = pred.with_robust(pred.robust)  # type: ignore[arg-type]
    out.memo_size = memo_size
    out.__post_init__()
    return out


def test_block_similarity_rows_do_not_depend_on_their_window() -> None:
    rng = np.random.default_rng(0)
    z = rng.standard_normal((3 * SIM_BLOCK_ROWS + 5, 16)).astype(np.float32)
    ZT = np.ascontiguousarray(rng.standard_normal((700, 16)).astype(np.float32).T)
    whole = block_similarity(z, ZT)
    np.testing.assert_allclose(whole, z @ ZT, rtol=1e-5, atol=1e-5)
    perm = rng.permutation(len(z))
    np.testing.assert_allclose(
        block_similarity(z[perm], ZT), whole[perm], rtol=SIM_RTOL, atol=SIM_RTOL
    )
    for i in (0, 7, len(z) - 1):
        np.testing.assert_allclose(
            block_similarity(z[i : i + 1], ZT)[0], whole[i], rtol=SIM_RTOL, atol=SIM_RTOL
        )


def test_window_predictions_equal_per_query_ones(knn: QualityPredictor) -> None:
    pred = _fresh(knn, 0)  # no memo: the window against each query alone
    texts = _texts(150, seed=4) + ["", "?", "x" * 5000]
    window = pred.predict(texts)
    for i, t in enumerate(texts):
        alone = pred.predict([t])
        for f in ("mean", "lower", "std"):
            np.testing.assert_allclose(
                getattr(alone, f)[0],
                getattr(window, f)[i],
                rtol=0,
                atol=PRED_ATOL,
                err_msg=f"{i} {f}",
            )


def test_memo_returns_the_same_predictions_and_counts_hits(knn: QualityPredictor) -> None:
    plain = _fresh(knn, 0)
    memo = _fresh(knn, 1000)
    first = _texts(120, seed=5)
    second = first[60:] + _texts(80, seed=6) + first[:3] + first[:3]  # repeats, and twice
    for texts in (first, second, second):
        a, b = plain.predict(texts), memo.predict(texts)
        for f in ("mean", "lower", "std"):
            np.testing.assert_allclose(
                getattr(a, f), getattr(b, f), rtol=0, atol=PRED_ATOL, err_msg=f
            )
    assert memo._memo is not None
    # second window: 60 + 3 + 3 of first seen before; third: all seen
    assert memo._memo.misses == 120 + 80
    assert memo._memo.hits == (len(second) - 80) + len(second)


def test_memo_keeps_the_newest_capacity_texts() -> None:
    memo = PredictionMemo(4, 2)
    keys = [text_key(f"t{i}") for i in range(6)]
    rows = np.arange(12, dtype=np.float64).reshape(6, 2)
    memo.store(keys[:3], rows[:3], rows[:3], rows[:3])
    memo.store(keys[3:], rows[3:], rows[3:], rows[3:])  # t0 and t1 make room
    slot = memo.lookup(keys)
    assert (slot[:2] == -1).all() and (slot[2:] >= 0).all() and len(memo) == 4
    assert np.array_equal(memo.mean[slot[2:]], rows[2:])
    memo.store([text_key(f"u{i}") for i in range(9)], *(np.ones((9, 2)),) * 3)  # > capacity
    assert len(memo) == 4 and (memo.lookup(keys) == -1).all()


def test_memo_size_is_checked(knn: QualityPredictor) -> None:
    with pytest.raises(ValueError, match="memo_size must be >= 0"):
        _fresh(knn, -1)
    with pytest.raises(ValueError, match="memo capacity must be >= 1"):
        PredictionMemo(0, 3)
