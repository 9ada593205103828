"""Gradient-boosted quality estimator (LightGBM), bootstrapped by leaf refits.

Why LightGBM rather than XGBoost: it is already a project dependency (pip wheel with
no extra system libraries), trains faster on CPU with histogram splits, handles the
model id as a native categorical feature, and ``predict(pred_leaf=True)`` exposes the
leaf of every tree, which the fast bootstrap below needs.

One booster is trained on stacked (query, model) rows, features ``[x_i, model j]``
(model categorical), L2 loss on the score. The bootstrap keeps the tree *structures*
and refits all leaf values for each of the ``B`` query resamples, replaying boosting
tree by tree with the replicate's weights:

    f_b <- mean_w(y);  for t = 1..T:  v_bt[l] = lr * sum_{r in l} w_br (y_r - f_b,r) / (sum_{r in l} w_br + lambda)
                                      f_b  += v_bt[leaf_t(r)]

``num_threads`` defaults to 1: LightGBM's OpenMP threads busy-wait, and on a shared
2-core machine one thread trained dc9 in 3 s where all cores took 20-30 s.

Prediction then needs one tree traversal for all replicates (leaf indices) plus a
gather-sum, instead of ``B`` boosters. Fixed structures understate the variance of a
full refit; the conformal step (``calibration.py``) corrects the interval width.
"""

from __future__ import annotations

from typing import Any

import lightgbm as lgb
import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from routing.quality.base import Arrays, Float32Array, bootstrap_weights, check_xy
from routing.types import FloatArray


class GBDTEstimator:
    name = "gbdt"

    def __init__(
        self,
        n_trees: int = 40,
        num_leaves: int = 31,
        learning_rate: float = 0.1,
        min_data_in_leaf: int = 40,
        lambda_l2: float = 1.0,
        seed: int = 0,
        num_threads: int = 1,
    ) -> None:
        self.n_trees = n_trees
        self.num_leaves = num_leaves
        self.learning_rate = learning_rate
        self.min_data_in_leaf = min_data_in_leaf
        self.lambda_l2 = lambda_l2
        self.seed = seed
        self.num_threads = num_threads
        self.booster: lgb.Booster | None = None
        self.n_models = 0
        self.values: npt.NDArray[np.float32] | None = None  # [B, T * L] leaf values
        self.values_t: npt.NDArray[np.float32] = np.zeros((0, 0), np.float32)  # [T * L, B]
        self.base: npt.NDArray[np.float32] | None = None  # [B]
        self.max_leaves = 0

    def _stack(self, X: Float32Array, m: int) -> npt.NDArray[np.float32]:
        n, d = X.shape
        out = np.empty((n, m, d + 1), dtype=np.float32)
        out[:, :, :d] = X[:, None, :]
        out[:, :, d] = np.arange(m, dtype=np.float32)[None, :]
        return out.reshape(n * m, d + 1)

    def _leaves(self, Xs: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        assert self.booster is not None
        leaf = self.booster.predict(Xs, pred_leaf=True, num_threads=self.num_threads)
        return np.asarray(leaf, dtype=np.int64).reshape(len(Xs), -1)

    def fit(
        self, X: Float32Array, Y: FloatArray, n_replicates: int = 20, seed: int = 0
    ) -> GBDTEstimator:
        X, Yz, mask = check_xy(X, Y)
        n, d = X.shape
        m = Yz.shape[1]
        self.n_models = m
        Xs_all = self._stack(X, m)
        obs = mask.ravel()
        Xs = Xs_all[obs]
        y = Yz.ravel()[obs]
        qrow = np.repeat(np.arange(n), m)[obs]
        params = {
            "objective": "regression",
            "num_leaves": self.num_leaves,
            "learning_rate": self.learning_rate,
            "min_data_in_leaf": self.min_data_in_leaf,
            "lambda_l2": self.lambda_l2,
            "feature_fraction": 0.9,
            "verbose": -1,
            "seed": self.seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": self.num_threads,
            "max_cat_to_onehot": 64,
        }
        ds = lgb.Dataset(Xs, label=y, categorical_feature=[d], free_raw_data=True)
        self.booster = lgb.train(params, ds, num_boost_round=self.n_trees)
        leaf = self._leaves(Xs)  # [R, T]
        T = leaf.shape[1]
        L = int(leaf.max()) + 1
        self.max_leaves = L
        W = bootstrap_weights(n, n_replicates, seed)  # [B, n]
        B = W.shape[0]
        w = W[:, qrow]  # [B, R]
        base = (w * y).sum(1) / np.maximum(w.sum(1), 1e-12)  # [B]
        f = np.repeat(base[:, None], len(y), axis=1)
        V = np.zeros((B, T, L), dtype=np.float64)
        offs = (np.arange(B) * L)[:, None]
        for t in range(T):
            flat = (offs + leaf[None, :, t]).ravel()
            s = np.bincount(flat, weights=(w * (y[None] - f)).ravel(), minlength=B * L).reshape(
                B, L
            )
            c = np.bincount(flat, weights=w.ravel(), minlength=B * L).reshape(B, L)
            v = self.learning_rate * s / (c + self.lambda_l2)
            V[:, t] = v
            f += np.take_along_axis(v, leaf[None, :, t].repeat(B, 0), axis=1)
        self.values = V.reshape(B, T * L).astype(np.float32)
        self.values_t = np.ascontiguousarray(self.values.T)
        self.base = base.astype(np.float32)
        return self

    def predict_replicates(self, X: Float32Array) -> npt.NDArray[np.float32]:
        if self.booster is None or self.values is None or self.base is None:
            raise RuntimeError("GBDTEstimator: fit() before predict")
        X = np.ascontiguousarray(X, dtype=np.float32)
        n, m = len(X), self.n_models
        if n == 0:
            return np.zeros((self.values.shape[0], 0, m), dtype=np.float32)
        leaf = self._leaves(self._stack(X, m))  # [R, T]
        T = leaf.shape[1]
        flat = (leaf + (np.arange(T) * self.max_leaves)[None, :]).ravel()
        # one-hot leaf matrix [R, T*L] (T ones per row) times the leaf values of all B
        # replicates [T*L, B]: one sparse product instead of B gathers
        onehot = sp.csr_matrix(
            (np.ones(flat.size, dtype=np.float32), flat, np.arange(0, flat.size + 1, T)),
            shape=(n * m, self.values.shape[1]),
        )
        B = self.values.shape[0]
        out = np.asarray(onehot @ self.values_t).T + self.base[:, None]  # [B, R]
        res: npt.NDArray[np.float32] = np.clip(out.reshape(B, n, m), 0.0, 1.0)
        return res

    def state(self) -> tuple[dict[str, Any], Arrays]:
        assert self.booster is not None and self.values is not None and self.base is not None
        params = {
            "n_trees": self.n_trees,
            "num_leaves": self.num_leaves,
            "learning_rate": self.learning_rate,
            "min_data_in_leaf": self.min_data_in_leaf,
            "lambda_l2": self.lambda_l2,
            "seed": self.seed,
            "num_threads": self.num_threads,
            "n_models": self.n_models,
            "max_leaves": self.max_leaves,
        }
        model = np.frombuffer(self.booster.model_to_string().encode("utf-8"), dtype=np.uint8)
        return params, {"booster": model, "values": self.values, "base": self.base}

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: Arrays) -> GBDTEstimator:
        e = cls(
            n_trees=int(params["n_trees"]),
            num_leaves=int(params["num_leaves"]),
            learning_rate=float(params["learning_rate"]),
            min_data_in_leaf=int(params["min_data_in_leaf"]),
            lambda_l2=float(params["lambda_l2"]),
            seed=int(params["seed"]),
            num_threads=int(params["num_threads"]),
        )
        e.n_models = int(params["n_models"])
        e.max_leaves = int(params["max_leaves"])
        e.booster = lgb.Booster(model_str=bytes(arrays["booster"]).decode("utf-8"))
        e.values = arrays["values"].astype(np.float32)
        e.values_t = np.ascontiguousarray(e.values.T)
        e.base = arrays["base"].astype(np.float32)
        return e
