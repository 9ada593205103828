"""Split-conformal calibration of the robust lower bound.

Nonconformity of a held-out (query, model) pair with realised score y:

    r = (mean - y) / (std + s0)

(std: bootstrap spread of that pair; s0: the median spread on the calibration set, so
pairs with a near-zero spread do not get an infinitely tight bound). With the
calibration scores r_1..r_N, the lower bound at nominal level ``level``

    lower = mean - kappa * (std + s0),   kappa = the ceil((N + 1) * level)-th smallest r

covers a new pair's realised score (y >= lower) with probability >= level when the
pairs are exchangeable (Vovk et al.; Lei et al. 2018). ``coverage`` measures it.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from routing.types import FloatArray


def nonconformity(mean: FloatArray, std: FloatArray, y: FloatArray, s0: float) -> FloatArray:
    ok = ~np.isnan(y)
    r: FloatArray = ((mean - y) / (std + s0))[ok]
    return r


def conformal_kappa(scores: npt.NDArray[np.floating], level: float) -> float:
    """Finite-sample conformal quantile of sorted-or-not ``scores`` at ``level``."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    s = np.sort(np.asarray(scores, dtype=np.float64))
    n = len(s)
    if n == 0:
        raise ValueError("no calibration scores")
    k = math.ceil((n + 1) * level)
    if k > n:
        return float(s[-1])  # too few points for this level: the most conservative bound we have
    return float(s[k - 1])


def coverage(lower: FloatArray, y: FloatArray) -> float:
    """Share of observed pairs whose realised score is at or above the lower bound."""
    ok = ~np.isnan(y)
    if not ok.any():
        return math.nan
    return float((y[ok] >= lower[ok] - 1e-12).mean())
