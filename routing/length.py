"""Output-length predictor: expected output tokens of each (query, model).

Feeds the cost model (``cost.py``) and the SFS TTFT estimator (a resident request's
predicted decode length). Two levels:

- untrained default: one number per model (a per-model mean where the data records
  output lengths, else a prior such as 256 tokens), usable with no training at all;
- trained: per-model ridge regression of ``log1p(output_tokens)`` on
  ``[1, log1p(prompt_tokens), text features]``, back-transformed with Duan's smearing
  factor so the prediction estimates the mean, not the median.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.types import FloatArray, IntArray

Arrays = dict[str, npt.NDArray[Any]]


class LengthPredictor:
    def __init__(
        self, models: Sequence[str], default_tokens: float | Sequence[float] = 256.0
    ) -> None:
        self.models = list(models)
        d = np.broadcast_to(
            np.asarray(default_tokens, dtype=np.float64), (len(self.models),)
        ).copy()
        if (d <= 0).any() or not np.isfinite(d).all():
            raise ValueError(f"default_tokens must be finite and > 0, got {d.tolist()}")
        self.default_tokens: FloatArray = d
        self.coef: FloatArray | None = None  # [p, m] for [1, log1p(prompt), X]
        self.smear: FloatArray | None = None  # [m]
        self.trained_models: npt.NDArray[np.bool_] = np.zeros(len(self.models), dtype=bool)
        self.featurizer: Any = None  # set by the quality predictor that owns this one

    @property
    def m(self) -> int:
        return len(self.models)

    def _design(
        self, prompt_tokens: IntArray | FloatArray, X: npt.NDArray[Any] | None
    ) -> FloatArray:
        p = np.log1p(np.asarray(prompt_tokens, dtype=np.float64))[:, None]
        parts = [np.ones_like(p), p]
        if X is not None:
            parts.append(np.asarray(X, dtype=np.float64))
        out: FloatArray = np.hstack(parts)
        return out

    def fit(
        self,
        output_tokens: FloatArray,
        prompt_tokens: IntArray,
        X: npt.NDArray[Any] | None = None,
        l2: float = 1.0,
        min_rows: int = 20,
    ) -> LengthPredictor:
        """Fit on ``output_tokens[n, m]`` (nan = unknown). Models with fewer than
        ``min_rows`` known lengths keep their default; others get the ridge fit and a
        default equal to their mean observed length."""
        out = np.asarray(output_tokens, dtype=np.float64)
        if out.shape != (len(prompt_tokens), self.m):
            raise ValueError(
                f"output_tokens must be [n, m] = [{len(prompt_tokens)}, {self.m}], got {out.shape}"
            )
        D = self._design(prompt_tokens, X)
        p = D.shape[1]
        coef = np.zeros((p, self.m))
        smear = np.ones(self.m)
        for j in range(self.m):
            ok = ~np.isnan(out[:, j]) & (out[:, j] >= 0)
            if ok.sum() < min_rows:
                continue
            y = np.log1p(out[ok, j])
            A = D[ok]
            reg = l2 * np.eye(p)
            reg[0, 0] = 0.0  # no penalty on the intercept
            coef[:, j] = np.linalg.solve(A.T @ A + reg, A.T @ y)
            resid = y - A @ coef[:, j]
            smear[j] = float(np.mean(np.exp(resid)))
            self.default_tokens[j] = float(out[ok, j].mean())
            self.trained_models[j] = True
        self.coef = coef if self.trained_models.any() else None
        self.smear = smear
        return self

    def predict_features(
        self, prompt_tokens: IntArray | FloatArray, X: npt.NDArray[Any] | None = None
    ) -> FloatArray:
        """Predicted output tokens ``[n, m]`` from prompt tokens and (optional) features."""
        n = len(prompt_tokens)
        base = np.broadcast_to(self.default_tokens[None, :], (n, self.m)).copy()
        if self.coef is None or self.smear is None:
            return base
        if X is None and self.coef.shape[0] > 2:
            return base  # trained with text features but none given: fall back to the mean
        D = self._design(prompt_tokens, X)
        pred = np.expm1(D @ self.coef) * self.smear[None, :]
        out: FloatArray = np.where(self.trained_models[None, :], np.maximum(pred, 1.0), base)
        return out

    def predict(self, texts: Sequence[str], prompt_tokens: IntArray) -> FloatArray:
        """Predicted output tokens ``[n, m]`` (features from the owner's featurizer)."""
        X = None
        if self.coef is not None and self.coef.shape[0] > 2 and self.featurizer is not None:
            X = self.featurizer.transform(texts)
        return self.predict_features(prompt_tokens, X)

    def state(self) -> tuple[dict[str, Any], Arrays]:
        arrays: Arrays = {
            "default_tokens": self.default_tokens,
            "trained_models": self.trained_models,
        }
        if self.coef is not None and self.smear is not None:
            arrays["coef"] = self.coef
            arrays["smear"] = self.smear
        return {"models": self.models}, arrays

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: Arrays) -> LengthPredictor:
        lp = cls(params["models"], [float(x) for x in arrays["default_tokens"]])
        lp.trained_models = arrays["trained_models"].astype(bool)
        if "coef" in arrays:
            lp.coef = arrays["coef"].astype(np.float64)
            lp.smear = arrays["smear"].astype(np.float64)
        return lp


# ---- residents: remaining output, conditional on what they have decoded ----------------------

# Fewer finished requests than this and a resident keeps its own routed prediction: the mean
# of n lengths with a coefficient of variation near 1 (the Azure conv outputs: 0.9-1.1) is
# off by ~1/sqrt(n); at 8 that is ~35%, no better than a routed prediction, and above it the
# empirical tail starts to carry information a single number does not.
MIN_FINISHED = 8
# Fewer finished lengths above a resident's decoded count than this and its tail is
# extrapolated (below) instead of averaged over one or two samples.
MIN_TAIL = 3


def conditional_output_tokens(
    decoded_tokens: IntArray,
    fallback_tokens: IntArray,
    finished_output_tokens: IntArray,
    *,
    min_finished: int = MIN_FINISHED,
    min_tail: int = MIN_TAIL,
) -> IntArray:
    """Predicted total output tokens of requests still decoding, given what each has decoded.

    ``decoded_tokens[i]``: tokens request ``i`` has produced so far (``d``);
    ``fallback_tokens[i]``: its own prediction (what it was routed with);
    ``finished_output_tokens``: output lengths of requests that finished recently on the same
    instance (the empirical length distribution ``L``).

    With at least ``min_finished`` finished lengths, a request that has decoded ``d >= 1``
    tokens is predicted ``d + E[L - d | L > d]`` (the empirical mean residual life), which is
    ``mean(L | L > d)``: the mean of the finished lengths longer than ``d``, or its own
    prediction where that is longer: the recent lengths say how long a request that has
    outlived ``d`` tokens tends to run, and a per-query prediction of a longer output (from
    the query's text) is kept rather than averaged away. Where fewer than
    ``min_tail`` of them exceed ``d`` (a request longer than nearly everything seen), the tail
    is taken memoryless beyond the last threshold that has ``min_tail`` samples: ``d + e0``,
    ``e0`` the mean residual life there (so the prediction is continuous in ``d`` and always
    above it). A request that has decoded nothing keeps its own prediction: the empirical
    mean knows nothing of it that its routed prediction (per query) does not. Every answer
    is at least ``d + 1`` (a request still resident produces at least one more token), as is
    the fallback where too few requests finished.
    """
    d = np.asarray(decoded_tokens, dtype=np.int64)
    fb = np.asarray(fallback_tokens, dtype=np.int64)
    if fb.shape != d.shape:
        raise ValueError(f"fallback_tokens has shape {fb.shape}, decoded_tokens {d.shape}")
    if min_finished < 1 or min_tail < 1:
        raise ValueError(f"min_finished and min_tail must be >= 1, got {min_finished}, {min_tail}")
    floor = d + 1
    lengths = np.sort(np.asarray(finished_output_tokens, dtype=np.int64).ravel())
    lengths = lengths[lengths >= 1]
    n = lengths.size
    if n < max(min_finished, 1) or d.size == 0:
        out: IntArray = np.maximum(fb, floor)
        return out
    m = min(min_tail, n)
    csum = np.concatenate([np.zeros(1), np.cumsum(lengths, dtype=np.float64)])
    above = np.searchsorted(lengths, d, side="right")  # first length > d
    count = n - above
    tail_mean = (csum[n] - csum[above]) / np.maximum(count, 1)
    # memoryless beyond the largest threshold t* that still has m lengths above it
    t_star = float(lengths[n - m]) - 1.0
    e0 = float(csum[n] - csum[n - m]) / m - t_star
    mrl = np.where(count >= m, tail_mean, d + e0)
    pred = np.where(d >= 1, np.maximum(np.rint(mrl).astype(np.int64), fb), fb)
    res: IntArray = np.maximum(pred, floor)
    return res
