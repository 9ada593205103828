"""Online recalibration of the step-time model (paper A's Eq. 9) from what a worker observes.

Pure: observations in, coefficients out; the worker (``workers.steptime_feed``) does the
clock reading and the Redis writes.

**Rows.** Eq. 9 is linear in its coefficients, so a *sum* of engine steps is as good a row
as one step: ``[steps, Σ N_tokens, Σ decode ctx, Σ q(q/2+ctx)]`` against the summed time.
A real vLLM server reports no per-step times, but a worker sees two sums of steps:

* **TTFT rows** (:func:`ttft_row`): from the request's send to its first streamed token the
  engine ran the steps that SFS simulates for the worker's residents at send time plus the
  new prompt. The batch composition SFS forms depends on token counts only (chunked-prefill
  budget, ``max_num_seqs``, KV blocks), never on the coefficients, so running SFS with the
  four unit models ``e_k`` gives the row's features exactly (SFS's own estimate is
  ``coef · row``). The target is the engine-side TTFT (sent → first token).
* **Decode rows** (:func:`decode_row`): while every request the worker has on the engine is
  decoding (no prefill, no arrival, no departure), ``k`` tokens of one of them took ``k``
  steps of the same decodes, each context growing by one per step.

Approximations, said plainly: the worker only knows its own requests (a server shared with
other clients breaks the rows; the worker's count is checked against the engine's own
``running`` count and rows are skipped when they differ); the residents' remaining output
lengths in a TTFT row are the router's predictions, as SFS uses them; the step in flight at
send time, requests sent while the prompt was prefilling, and the API server's own time
(tokenising, HTTP, SSE) are not modelled and land in the residuals (the API server's share
is absorbed mostly by ``c0``). These are the same errors SFS makes when routing, so the
refit minimises SFS's own TTFT error on the traffic it will be asked about.

**Fit** (:class:`OnlineRefit`): a windowed (most recent ``window_rows``) non-negative least
squares of *relative* error (each row divided by its measured time, like
``routing.steptime.fit_nnls``), with

* outliers bounded by a Huber loss, solved by iteratively re-weighted NNLS: a row whose
  relative residual exceeds ``huber_delta`` gets weight ``huber_delta / |r|``, and a row the
  current fit prices more than ``trim_ratio`` times above or below its measurement is
  dropped from the next iteration (trimmed; never the majority of rows) — a stalled stream,
  a GC pause, a prefix-cache hit or a preemption the rows do not model cannot swing the fit;
* a prior — the configured profile — worth ``prior_rows`` observations: for each
  coefficient a pseudo-row pulls its *share of a typical row's time* towards the prior's
  share, so with few observations the fit stays near the profile, and with many the data
  win (the pull is about ``prior_rows / (prior_rows + n)``). A coefficient whose feature the
  window never exercised (no prefill attention seen, say) stays at the prior.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls

from routing.sfs import estimate_ttft_ms
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_UNIT_MODELS = (
    StepTimeModel(1.0, 0.0, 0.0, 0.0),
    StepTimeModel(0.0, 1.0, 0.0, 0.0),
    StepTimeModel(0.0, 0.0, 1.0, 0.0),
    StepTimeModel(0.0, 0.0, 0.0, 1.0),
)


def ttft_row(
    state: InstanceState,
    prompt_tokens: int,
    sched: SchedulerConfig,
    hit_tokens: int = 0,
) -> FloatArray:
    """Eq. 9 features summed over the steps SFS forms until ``prompt_tokens``' first token,
    appended to ``state`` (the residents on the engine when it was sent). ``coef @ row`` is
    SFS's TTFT estimate with ``coef``. Raises ``ValueError`` for a prompt the KV cache can
    never hold (SFS answers "never" for it: no row)."""
    p = np.array([max(1, int(prompt_tokens))], dtype=np.int64)
    h = np.array([max(0, min(int(hit_tokens), int(p[0]) - 1))], dtype=np.int64)
    row = np.array(
        [float(estimate_ttft_ms(state, p, m, sched, hit_tokens=h)[0]) for m in _UNIT_MODELS]
    )
    from routing.sfs import UNSERVABLE_MS

    if row[0] >= UNSERVABLE_MS:
        raise ValueError(
            f"ttft_row: a prompt of {int(p[0])} tokens never fits this instance's KV cache"
        )
    return row


def decode_row(context_tokens: Sequence[int] | IntArray, steps: int) -> FloatArray:
    """Eq. 9 features of ``steps`` pure-decode steps of the same requests, whose contexts
    (prompt + tokens generated so far) are ``context_tokens`` on the first step and grow by
    one per step."""
    ctx = np.asarray(context_tokens, dtype=np.float64)
    if ctx.ndim != 1 or ctx.size == 0:
        raise ValueError("decode_row: context_tokens must list at least one decode")
    if steps < 1:
        raise ValueError(f"decode_row: steps must be >= 1, got {steps}")
    n = float(ctx.size)
    k = float(steps)
    return np.array([k, k * n, k * float(ctx.sum()) + n * k * (k - 1.0) / 2.0, 0.0])


@dataclass(frozen=True)
class RefitConfig:
    """Knobs of the online refit (documented in the module docstring)."""

    window_rows: int = 2048  # the most recent observations kept
    prior_rows: float = 16.0  # the configured profile counts as this many observations
    huber_delta: float = 0.2  # relative residual beyond which a row's weight falls off
    # a row the current fit prices more than this many times above or below its measured
    # time is dropped from the next iteration (trimmed): Huber alone still lets 5% of gross
    # outliers (a prefix-cache hit nobody knew of: 10x faster) drag the fit
    trim_ratio: float = 3.0
    irls_iterations: int = 8
    min_rows: int = 8  # fewer observations: the prior as it is

    def __post_init__(self) -> None:
        if self.window_rows < 8:
            raise ValueError(f"RefitConfig.window_rows must be >= 8, got {self.window_rows}")
        if not (math.isfinite(self.prior_rows) and self.prior_rows >= 0):
            raise ValueError(f"RefitConfig.prior_rows must be >= 0, got {self.prior_rows}")
        if not (math.isfinite(self.huber_delta) and self.huber_delta > 0):
            raise ValueError(f"RefitConfig.huber_delta must be > 0, got {self.huber_delta}")
        if not (math.isfinite(self.trim_ratio) and self.trim_ratio > 1):
            raise ValueError(f"RefitConfig.trim_ratio must be > 1, got {self.trim_ratio}")
        if self.irls_iterations < 1:
            raise ValueError(
                f"RefitConfig.irls_iterations must be >= 1, got {self.irls_iterations}"
            )
        if self.min_rows < 1:
            raise ValueError(f"RefitConfig.min_rows must be >= 1, got {self.min_rows}")


@dataclass(frozen=True)
class RefitResult:
    """One refit: the model, how many rows it saw, and its error on them."""

    model: StepTimeModel
    n_rows: int
    mape: float  # mean |predicted - measured| / measured over the window's rows (a fraction)
    prior_mape: float  # the same for the prior


class OnlineRefit:
    """Eq. 9 coefficients of one model, refitted from a window of observed rows."""

    def __init__(self, prior: StepTimeModel, config: RefitConfig = RefitConfig()) -> None:
        self.prior = prior
        self.config = config
        cap = config.window_rows
        self._X = np.zeros((cap, 4))
        self._y = np.zeros(cap)
        self._n = 0  # rows held
        self._next = 0  # ring position
        self.added = 0  # rows accepted in all
        self.rejected = 0  # rows refused (not finite, not positive)
        self.model = prior

    @property
    def n_rows(self) -> int:
        return self._n

    def add(self, row: FloatArray | Sequence[float], t_ms: float) -> bool:
        """Keep one observation (features, measured ms); False (counted) when it is unusable."""
        x = np.asarray(row, dtype=np.float64)
        if (
            x.shape != (4,)
            or not np.isfinite(x).all()
            or (x < 0).any()
            or x[0] <= 0
            or not math.isfinite(t_ms)
            or t_ms <= 0
        ):
            self.rejected += 1
            return False
        self._X[self._next] = x
        self._y[self._next] = t_ms
        self._next = (self._next + 1) % self.config.window_rows
        self._n = min(self._n + 1, self.config.window_rows)
        self.added += 1
        return True

    def rows(self) -> tuple[FloatArray, FloatArray]:
        """The window's rows (features, measured ms), oldest first."""
        if self._n < self.config.window_rows:
            return self._X[: self._n].copy(), self._y[: self._n].copy()
        order = np.r_[self._next : self._n, 0 : self._next]
        return self._X[order], self._y[order]

    def refit(self) -> RefitResult:
        """Refit on the window (``self.model`` becomes the result); the prior below
        ``min_rows`` observations."""
        X, y = self.rows()
        prior = self.prior.coef
        if self._n < self.config.min_rows:
            self.model = self.prior
            err = _mape(X, y, prior)
            return RefitResult(self.prior, self._n, err, err)
        coef = fit_with_prior(X, y, prior, self.config)
        self.model = StepTimeModel(*(float(c) for c in coef))
        return RefitResult(self.model, self._n, _mape(X, y, coef), _mape(X, y, prior))


def _mape(X: FloatArray, y: FloatArray, coef: FloatArray) -> float:
    if y.size == 0:
        return math.nan
    return float(np.mean(np.abs(X @ coef - y) / y))


def fit_with_prior(
    X: FloatArray, y: FloatArray, prior: FloatArray, config: RefitConfig = RefitConfig()
) -> FloatArray:
    """Huber-weighted, relative-error NNLS of ``X c ≈ y`` pulled towards ``prior`` (see the
    module docstring); returns ``c >= 0``."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    p = np.asarray(prior, dtype=np.float64)
    if X.ndim != 2 or X.shape[1] != 4 or y.shape != (X.shape[0],) or p.shape != (4,):
        raise ValueError(
            f"fit_with_prior: X must be (n, 4), y (n,), prior (4,); got "
            f"{X.shape}, {y.shape}, {p.shape}"
        )
    if y.size == 0 or (y <= 0).any() or not (np.isfinite(X).all() and np.isfinite(y).all()):
        raise ValueError("fit_with_prior: needs finite rows with measured times > 0")
    R = X / y[:, None]  # relative rows: R c ≈ 1
    share = R.mean(axis=0)  # a typical row's feature, per ms measured
    free = share > 0  # coefficients the window exercised; the rest stay at the prior
    coef = p.copy()
    if not free.any():
        return coef
    Rf = R[:, free]
    target = 1.0 - R[:, ~free] @ p[~free]
    lam = math.sqrt(config.prior_rows)
    prior_rows = lam * np.diag(share[free])
    prior_target = lam * share[free] * p[free]
    scale = np.abs(np.vstack([Rf, prior_rows])).max(axis=0)
    scale[scale == 0] = 1.0
    w = np.ones(y.size)
    sol = p[free]
    for _ in range(config.irls_iterations):
        sw = np.sqrt(w)
        A = np.vstack([Rf * sw[:, None], prior_rows]) / scale
        b = np.concatenate([target * sw, prior_target])
        z, _ = nnls(A, b, maxiter=50 * A.shape[1])
        sol = z / scale
        fitted = Rf @ sol
        r = np.abs(fitted - target)
        w_new = np.where(r <= config.huber_delta, 1.0, config.huber_delta / np.maximum(r, 1e-12))
        ratio = np.maximum(fitted, 1e-12) / np.maximum(target, 1e-12)
        trimmed = (ratio > config.trim_ratio) | (ratio < 1.0 / config.trim_ratio)
        if trimmed.mean() < 0.5:  # never trim the majority: that is a wrong fit, not outliers
            w_new = np.where(trimmed, 0.0, w_new)
        if np.allclose(w_new, w, rtol=1e-3, atol=1e-6):
            break
        w = w_new
    coef[free] = sol
    return coef
