"""IRT-style quality estimator: query latent traits x model abilities (MIRT).

    P(model j solves query i) = sigmoid(b_j + theta_i . a_j),   theta_i = x_i W

``theta_i`` (K traits) comes from the query's text features through a learnt linear
map ``W`` [d, K], so unseen queries get traits too (as IRT-Router does with query
embeddings); ``a_j`` [K] are the model's abilities along the traits and ``b_j`` its
overall ability. Fitted by minimising weighted cross-entropy against the scores
(graded scores in [0, 1] act as soft labels) plus an L2 penalty, with L-BFGS on the
analytic gradient. All ``B`` bootstrap replicates are fitted in one joint problem
(the objective is a sum of independent per-replicate terms), started from the
full-data fit. Defaults (K = 16, l2 = 3e-5) were chosen on dc9's training queries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.optimize import minimize

from routing.quality.base import Arrays, Float32Array, bootstrap_weights, check_xy
from routing.types import FloatArray


def _sigmoid(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    out: npt.NDArray[np.float64] = 0.5 * (1.0 + np.tanh(0.5 * x))
    return out


class IRTEstimator:
    name = "irt"

    def __init__(
        self, n_traits: int = 16, l2: float = 3e-5, max_iter: int = 300, seed: int = 0
    ) -> None:
        if n_traits < 1:
            raise ValueError(f"n_traits must be >= 1, got {n_traits}")
        self.n_traits = n_traits
        self.l2 = l2
        self.max_iter = max_iter
        self.seed = seed
        self.W: npt.NDArray[np.float32] | None = None  # [B, d, K]
        self.A: npt.NDArray[np.float32] | None = None  # [B, m, K]
        self.b: npt.NDArray[np.float32] | None = None  # [B, m]

    def _solve(
        self,
        X: npt.NDArray[np.float64],
        Y: npt.NDArray[np.float64],
        mask: npt.NDArray[np.float64],
        weights: npt.NDArray[np.float64],  # [B, n]
        init: npt.NDArray[np.float64],
        max_iter: int,
    ) -> npt.NDArray[np.float64]:
        B, n = weights.shape
        d, m, K = X.shape[1], Y.shape[1], self.n_traits
        sizes = (d * K, m * K, m)
        per = sum(sizes)
        wm = weights[:, :, None] * mask[None]  # [B, n, m]
        norm = wm.sum(axis=(1, 2))[:, None, None]
        wm = wm / np.maximum(norm, 1e-12)
        lam = self.l2

        def unpack(theta: npt.NDArray[np.float64]) -> tuple[Any, Any, Any]:
            t = theta.reshape(B, per)
            W = t[:, : sizes[0]].reshape(B, d, K)
            A = t[:, sizes[0] : sizes[0] + sizes[1]].reshape(B, m, K)
            b = t[:, sizes[0] + sizes[1] :]
            return W, A, b

        def fun(theta: npt.NDArray[np.float64]) -> tuple[float, npt.NDArray[np.float64]]:
            W, A, b = unpack(theta)
            # all products are BLAS matmuls (einsum without BLAS is ~5x slower here)
            T = (X @ W.transpose(1, 0, 2).reshape(d, B * K)).reshape(n, B, K).transpose(1, 0, 2)
            L = b[:, None, :] + T @ A.transpose(0, 2, 1)  # [B, n, m]
            P = _sigmoid(L)
            # cross-entropy with soft labels, stable form: softplus(L) - y L
            ce = np.logaddexp(0.0, L) - Y[None] * L
            loss = float((wm * ce).sum()) + lam * float((W**2).sum() + (A**2).sum())
            G = wm * (P - Y[None])  # [B, n, m]
            gA = G.transpose(0, 2, 1) @ T + 2 * lam * A
            gT = G @ A  # [B, n, K]
            gW = (X.T @ gT.transpose(1, 0, 2).reshape(n, B * K)).reshape(d, B, K).transpose(1, 0, 2)
            gW = gW + 2 * lam * W
            gb = G.sum(axis=1)
            grad = np.concatenate([gW.reshape(B, -1), gA.reshape(B, -1), gb], axis=1).ravel()
            return loss, grad

        res = minimize(
            fun, init.ravel(), jac=True, method="L-BFGS-B", options={"maxiter": max_iter}
        )
        out: npt.NDArray[np.float64] = np.asarray(res.x).reshape(B, per)
        return out

    def fit(
        self, X: Float32Array, Y: FloatArray, n_replicates: int = 20, seed: int = 0
    ) -> IRTEstimator:
        X32, Yz, mask = check_xy(X, Y)
        Xd = X32.astype(np.float64)
        n, d = Xd.shape
        m, K = Yz.shape[1], self.n_traits
        rng = np.random.default_rng(self.seed)
        mean = (Yz * mask).sum(0) / np.maximum(mask.sum(0), 1)
        p = np.clip(mean, 0.02, 0.98)
        init = np.concatenate(
            [rng.normal(0, 0.1, d * K), rng.normal(0, 0.1, m * K), np.log(p / (1 - p))]
        )[None]
        maskf = mask.astype(np.float64)
        full = self._solve(Xd, Yz, maskf, np.ones((1, n)), init, self.max_iter)
        if n_replicates > 1:
            W = bootstrap_weights(n, n_replicates, seed)
            # replicates start at the full-data optimum: a third of the iterations suffices
            start = np.repeat(full, n_replicates, axis=0)
            theta = self._solve(Xd, Yz, maskf, W, start, max(self.max_iter // 3, 20))
        else:
            theta = full
        B = theta.shape[0]
        self.W = theta[:, : d * K].reshape(B, d, K).astype(np.float32)
        self.A = theta[:, d * K : d * K + m * K].reshape(B, m, K).astype(np.float32)
        self.b = theta[:, d * K + m * K :].astype(np.float32)
        return self

    def predict_replicates(self, X: Float32Array) -> npt.NDArray[np.float32]:
        if self.W is None or self.A is None or self.b is None:
            raise RuntimeError("IRTEstimator: fit() before predict")
        X = np.ascontiguousarray(X, dtype=np.float32)
        B, d, K = self.W.shape
        T = (X @ self.W.transpose(1, 0, 2).reshape(d, B * K)).reshape(len(X), B, K)  # [n, B, K]
        L = np.einsum("nbk,bmk->bnm", T, self.A, optimize=True) + self.b[:, None, :]
        out: npt.NDArray[np.float32] = (0.5 * (1.0 + np.tanh(0.5 * L))).astype(np.float32)
        return out

    def state(self) -> tuple[dict[str, Any], Arrays]:
        assert self.W is not None and self.A is not None and self.b is not None
        params = {
            "n_traits": self.n_traits,
            "l2": self.l2,
            "max_iter": self.max_iter,
            "seed": self.seed,
        }
        return params, {"W": self.W, "A": self.A, "b": self.b}

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: Arrays) -> IRTEstimator:
        e = cls(
            n_traits=int(params["n_traits"]),
            l2=float(params["l2"]),
            max_iter=int(params["max_iter"]),
            seed=int(params["seed"]),
        )
        e.W, e.A, e.b = arrays["W"], arrays["A"], arrays["b"]
        return e
