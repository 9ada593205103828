"""Step-time model: paper A's "Eq. 9" (DESIGN.md, "Step-time model").

The duration of one engine step (one token batch) is linear in four features::

    t_ms = c0 + c1 * N_tokens + c2 * sum_decodes ctx_d + c3 * sum_prefill_chunks q_p * (q_p / 2 + ctx_p)

* ``c0``: fixed per-step overhead (scheduling, sampling, kernel launches);
* ``c1``: dense-layer work, linear in the number of tokens in the batch;
* ``c2``: decode attention / KV-cache reads, linear in each decode's context length;
* ``c3``: prefill attention, quadratic within a chunk: a chunk of ``q`` new tokens on top
  of ``ctx`` cached ones computes ``q * (q / 2 + ctx)`` query-key pairs (causal mask).

The coefficients are fitted by non-negative least squares (:func:`fit_nnls`) from
measured step timings (``routing.profiles``) or from timings workers observe online.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls

from schemas import StepTimeCoefficients

FloatArray = npt.NDArray[np.float64]
ArrayLike = npt.ArrayLike

FEATURE_NAMES = ("steps", "n_tokens", "decode_ctx_tokens", "prefill_attn_units")


def attn_units(chunk_tokens: ArrayLike, ctx_tokens: ArrayLike) -> FloatArray:
    """Causal attention work of prefill chunks: ``q * (q / 2 + ctx)`` each."""
    q = np.asarray(chunk_tokens, dtype=np.float64)
    c = np.asarray(ctx_tokens, dtype=np.float64)
    return np.asarray(q * (q / 2.0 + c), dtype=np.float64)


@dataclass(frozen=True)
class StepTimeModel:
    """Eq. 9 coefficients, all in milliseconds (per step, per token, per ctx token, per unit)."""

    c0_ms: float
    c1_ms_per_token: float
    c2_ms_per_ctx_token: float
    c3_ms_per_attn_unit: float

    def __post_init__(self) -> None:
        for name in ("c0_ms", "c1_ms_per_token", "c2_ms_per_ctx_token", "c3_ms_per_attn_unit"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"StepTimeModel.{name} must be a finite number >= 0, got {value}")

    @classmethod
    def from_coefficients(cls, coef: StepTimeCoefficients) -> StepTimeModel:
        return cls(
            c0_ms=coef.c0_ms,
            c1_ms_per_token=coef.c1_ms_per_token,
            c2_ms_per_ctx_token=coef.c2_ms_per_ctx_token,
            c3_ms_per_attn_unit=coef.c3_ms_per_attn_unit,
        )

    def to_coefficients(self) -> StepTimeCoefficients:
        return StepTimeCoefficients(
            c0_ms=self.c0_ms,
            c1_ms_per_token=self.c1_ms_per_token,
            c2_ms_per_ctx_token=self.c2_ms_per_ctx_token,
            c3_ms_per_attn_unit=self.c3_ms_per_attn_unit,
        )

    @property
    def coef(self) -> FloatArray:
        """``[c0, c1, c2, c3]`` as an array (the order of :data:`FEATURE_NAMES`)."""
        return np.array(
            [self.c0_ms, self.c1_ms_per_token, self.c2_ms_per_ctx_token, self.c3_ms_per_attn_unit]
        )

    def step_ms(
        self,
        n_tokens: ArrayLike,
        decode_ctx_tokens: ArrayLike = 0.0,
        prefill_attn_units: ArrayLike = 0.0,
    ) -> FloatArray:
        """Eq. 9 for one or many steps (broadcasting numpy arrays).

        ``decode_ctx_tokens`` is the sum of the decodes' context lengths in each step and
        ``prefill_attn_units`` the sum of ``q * (q / 2 + ctx)`` over its prefill chunks
        (see :func:`attn_units`).
        """
        n = np.asarray(n_tokens, dtype=np.float64)
        d = np.asarray(decode_ctx_tokens, dtype=np.float64)
        a = np.asarray(prefill_attn_units, dtype=np.float64)
        out = (
            self.c0_ms
            + self.c1_ms_per_token * n
            + self.c2_ms_per_ctx_token * d
            + self.c3_ms_per_attn_unit * a
        )
        return np.asarray(out, dtype=np.float64)

    def prefill_ms(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike = 0.0) -> FloatArray:
        """Time of a lone prefill of ``prompt_tokens`` (one step, nothing else batched)."""
        p = np.asarray(prompt_tokens, dtype=np.float64)
        k = np.asarray(cached_tokens, dtype=np.float64)
        return self.step_ms(p - k, 0.0, attn_units(p - k, k))


def features(
    n_tokens: ArrayLike, decode_ctx_tokens: ArrayLike, prefill_attn_units: ArrayLike
) -> FloatArray:
    """Design matrix ``[1, N, sum ctx, sum q(q/2+ctx)]``, one row per step."""
    n = np.atleast_1d(np.asarray(n_tokens, dtype=np.float64))
    d = np.broadcast_to(np.asarray(decode_ctx_tokens, dtype=np.float64), n.shape)
    a = np.broadcast_to(np.asarray(prefill_attn_units, dtype=np.float64), n.shape)
    return np.column_stack([np.ones_like(n), n, d, a])


@dataclass(frozen=True)
class FitReport:
    """How well a fitted model reproduces the timings it was fitted on."""

    model: StepTimeModel
    n_rows: int
    mape: float  # mean absolute percentage error, as a fraction (0.05 = 5%)
    p90_ape: float
    max_ape: float


def fit_nnls(
    X: ArrayLike,
    t_ms: ArrayLike,
    weights: ArrayLike | None = None,
    relative: bool = True,
) -> FitReport:
    """Fit Eq. 9 by non-negative least squares.

    ``X`` is the design matrix from :func:`features` (n x 4) and ``t_ms`` the measured step
    times. With ``relative=True`` (default) each row is divided by its measured time, so the
    fit minimises squared *relative* error: decode steps of a few ms and prefill steps of
    hundreds of ms count alike, which is what a TTFT estimator needs. Columns are rescaled
    before solving so the solver is well conditioned.
    """
    A = np.asarray(X, dtype=np.float64)
    y = np.asarray(t_ms, dtype=np.float64)
    if A.ndim != 2 or A.shape[1] != 4:
        raise ValueError(f"fit_nnls: X must have shape (n, 4), got {A.shape}")
    if y.shape != (A.shape[0],):
        raise ValueError(f"fit_nnls: t_ms must have {A.shape[0]} rows, got shape {y.shape}")
    if A.shape[0] < 4:
        raise ValueError(f"fit_nnls: need at least 4 timings, got {A.shape[0]}")
    if not (np.isfinite(A).all() and np.isfinite(y).all()):
        raise ValueError("fit_nnls: X and t_ms must be finite")
    if (y <= 0).any():
        raise ValueError(
            f"fit_nnls: step times must be > 0 ms, row {int(np.argmax(y <= 0))} is not"
        )
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    if relative:
        w = w / y
    Aw = A * w[:, None]
    yw = y * w
    scale = np.abs(Aw).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(Aw / scale, yw, maxiter=50 * A.shape[1])
    coef = coef / scale
    model = StepTimeModel(*(float(c) for c in coef))
    ape = np.abs(A @ coef - y) / y
    return FitReport(
        model=model,
        n_rows=int(y.size),
        mape=float(ape.mean()),
        p90_ape=float(np.quantile(ape, 0.9)),
        max_ape=float(ape.max()),
    )
