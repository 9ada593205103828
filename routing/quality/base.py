"""Shared pieces of the quality estimators: the estimate type and the bootstrap.

Every estimator family fits ``B`` bootstrap replicates at once (paper B: prediction
intervals "from bootstrap resampling of the quality estimator") and predicts all of
them in one vectorised call, ``predict_replicates(X) -> [B, n, m]``. A replicate is a
resample of whole *queries* (weights ~ multinomial counts), never of single
(query, model) rows, so a query's scores stay together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from routing.types import FloatArray

Float32Array = npt.NDArray[np.float32]
Arrays = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class QualityEstimate:
    """Predicted quality of each (query, model), ``[n, m]`` arrays.

    ``mean``: bootstrap mean (the point estimate); ``lower``: the robust value, a lower
    bound at the predictor's nominal level (after conformal calibration); ``std``: the
    bootstrap standard deviation (epistemic spread).
    """

    mean: FloatArray
    lower: FloatArray
    std: FloatArray


class ReplicateEstimator(Protocol):
    """One estimator family, fitted as ``B`` bootstrap replicates."""

    name: str

    def fit(
        self, X: Float32Array, Y: FloatArray, n_replicates: int, seed: int
    ) -> ReplicateEstimator: ...

    def predict_replicates(self, X: Float32Array) -> npt.NDArray[np.float32]: ...

    def state(self) -> tuple[dict[str, Any], Arrays]: ...


def bootstrap_weights(n: int, n_replicates: int, seed: int) -> FloatArray:
    """``[B, n]`` multinomial resample counts of ``n`` queries; replicate 0 of a single
    replicate (``B == 1``) is the plain fit with unit weights."""
    if n_replicates < 1:
        raise ValueError(f"n_replicates must be >= 1, got {n_replicates}")
    if n_replicates == 1:
        return np.ones((1, n), dtype=np.float64)
    rng = np.random.default_rng(seed)
    w: FloatArray = rng.multinomial(n, np.full(n, 1.0 / n), size=n_replicates).astype(np.float64)
    return w


def check_xy(
    X: Float32Array, Y: FloatArray
) -> tuple[Float32Array, FloatArray, npt.NDArray[np.bool_]]:
    """Validate shapes; return float32 features, scores with nan -> 0, and the observed mask."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    Y = np.asarray(Y, dtype=np.float64)
    if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != Y.shape[0]:
        raise ValueError(
            f"X must be [n, d] and Y [n, m] with the same n, got {X.shape} and {Y.shape}"
        )
    if X.shape[0] == 0:
        raise ValueError("no training queries")
    mask = ~np.isnan(Y)
    return X, np.where(mask, Y, 0.0), mask
