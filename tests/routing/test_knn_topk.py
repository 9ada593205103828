"""``knn.largest_k``: the k largest values of each row, exactly, against a full sort."""

from __future__ import annotations

import numpy as np
import pytest

from routing.quality.knn import TOPK_GROUPS, largest_k


def _reference(a: np.ndarray, k: int) -> np.ndarray:
    """The k largest by (value descending, column): a full stable sort of each row."""
    return np.argsort(-a, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("cols", [1, 7, 2 * TOPK_GROUPS - 1, 2 * TOPK_GROUPS, 4432, 5000])
@pytest.mark.parametrize("k", [1, 5, 48])
def test_largest_k_equals_a_full_sort(cols: int, k: int) -> None:
    if k > cols:
        pytest.skip("k > columns")
    rng = np.random.default_rng(cols * 100 + k)
    a = rng.random((37, cols), dtype=np.float32) * 2 - 1  # similarities, as the kNN has them
    got = largest_k(a, k)
    assert got.shape == (37, k) and got.dtype == np.int64
    np.testing.assert_array_equal(got, _reference(a, k))
    # the same values as numpy's selection (which orders and breaks ties its own way)
    sel = -np.sort(-np.take_along_axis(a, np.argpartition(-a, k - 1, axis=1)[:, :k], 1), 1)
    np.testing.assert_array_equal(np.take_along_axis(a, got, 1), sel)


def test_ties_go_to_the_lower_column() -> None:
    # duplicate training queries give equal similarities: the k-th place is a tie of three
    rng = np.random.default_rng(1)
    a = -rng.random((4, 3000), dtype=np.float32)
    a[:, [100, 2000, 2999]] = 1.0  # three best, tied
    a[:, [5, 700]] = 2.0  # two better still
    got = largest_k(a, 4)
    np.testing.assert_array_equal(got, np.tile([5, 700, 100, 2000], (4, 1)))


def test_many_equal_values_and_nan_rows() -> None:
    a = np.zeros((3, 1000), dtype=np.float32)
    a[1, 999] = 1.0
    a[2, 10] = np.nan  # NaN sorts last
    a[0, 1::2] = -0.0  # equal to 0.0: ties, by column
    got = largest_k(a, 48)
    np.testing.assert_array_equal(got, _reference(a, 48))
    assert got[1, 0] == 999 and list(got[0]) == list(range(48))


def test_no_rows_and_bad_k() -> None:
    assert largest_k(np.zeros((0, 4432), dtype=np.float32), 48).shape == (0, 48)
    with pytest.raises(ValueError, match="k must be in"):
        largest_k(np.zeros((2, 10), dtype=np.float32), 11)
    with pytest.raises(ValueError, match="k must be in"):
        largest_k(np.zeros((2, 10), dtype=np.float32), 0)


@pytest.mark.parametrize("seed", range(5))
def test_many_ties_negative_values_and_nan_in_wide_rows(seed: int) -> None:
    # values drawn from a few levels (ties at every rank), signed zeros, NaN in some rows
    rng = np.random.default_rng(seed)
    levels = np.array([-1.0, -0.5, -0.0, 0.0, 0.25, 0.5, 1.0], dtype=np.float32)
    a = levels[rng.integers(0, levels.size, (70, 4432))]
    a[3, rng.integers(0, 4432, 5)] = np.nan
    for k in (1, 48, 200):
        np.testing.assert_array_equal(largest_k(a, k), _reference(a, k))
