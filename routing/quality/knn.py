"""k-nearest-neighbour quality estimator (cosine similarity on the text features).

    q_hat[i, j] = sum_{k in N(i)} w_k s_ik y_kj / sum_{k in N(i)} w_k s_ik

with N(i) the ``k`` most similar training queries, s the (clipped) cosine similarity
and w_k the bootstrap count of query k in a replicate. One neighbour search serves
all ``B`` replicates (replicates differ only by the counts w), so the bootstrap costs
one extra weighted average, not ``B`` searches.

The similarities are computed in fixed blocks of ``SIM_BLOCK_ROWS`` query rows (the last
one zero-padded): BLAS picks its kernel by the shapes of a call (a single row goes to a
matrix-vector kernel, whose sums round differently), so one call per window would make a
query's prediction depend on how many others shared its window. With every call the same
shape, a query predicts the same alone as in any window (bit for bit on CPUs whose BLAS
kernel rounds every row of a block alike; to ~1e-7 relative where a row's position in the
block changes its rounding, as on an AMD EPYC with OpenBLAS 0.3.31), which is what lets
``QualityPredictor`` memoise predictions by text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.quality.base import Arrays, Float32Array, bootstrap_weights, check_xy
from routing.types import FloatArray

SIM_BLOCK_ROWS = 64  # query rows per similarity matrix product (module docstring)
TOPK_GROUPS = 128  # column groups of the top-k prefilter (``largest_k``)


def largest_k(a: Float32Array, k: int) -> npt.NDArray[np.int64]:
    """Per row of ``a``, the columns of its ``k`` largest values, largest first; ties go to
    the lower column, NaN counts as the smallest. Exact: the same as a full stable sort of
    ``-a`` (``np.argsort(-a, kind="stable")[:, :k]``), about 10x cheaper for a few thousand
    columns.

    The columns are dealt into ``G`` groups (column c to group c mod G, one reshape) and
    each group's maximum taken; the k-th largest of those maxima, t, has at least k values
    >= t (one per group), so the k largest are among the values >= t — typically a few
    dozen of thousands. Those are gathered (one pass) and sorted by one int64 key per value
    (row, then the value's float32 bits ordered largest first, then column)."""
    n, cols = a.shape
    if not 1 <= k <= cols:
        raise ValueError(f"k must be in [1, {cols}], got {k}")
    groups = max(TOPK_GROUPS, 2 * k)
    col_bits = max(1, (cols - 1).bit_length())
    if cols < 2 * groups or n == 0 or (n - 1).bit_length() + 32 + col_bits > 63:
        return _largest_k_sorted(a, k)
    full = cols - cols % groups
    gmax = a[:, :full].reshape(n, -1, groups).max(axis=1)  # group g: columns g, g + G, ...
    if full < cols:
        np.maximum(gmax[:, : cols - full], a[:, full:], out=gmax[:, : cols - full])
    t = np.partition(gmax, groups - k, axis=1)[:, groups - k]
    flat = np.flatnonzero(a >= t[:, None])  # row-major: by row, then by column
    count = np.bincount(flat // cols, minlength=n)
    if count.min() < k:  # NaN in a row (no value compares >= NaN)
        return _largest_k_sorted(a, k)
    rows, col = np.divmod(flat, cols)
    # +0.0 makes -0.0 equal to 0.0, as the comparisons of a sort see them
    bits = (a.ravel()[flat] + np.float32(0.0)).view(np.int32).astype(np.int64)
    ordered = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ascending as the floats
    key = (rows << (32 + col_bits)) | ((0x7FFFFFFF - ordered) << col_bits) | col
    key.sort()
    first = np.cumsum(count) - count
    out: npt.NDArray[np.int64] = key[first[:, None] + np.arange(k)] & ((1 << col_bits) - 1)
    return out


def _largest_k_sorted(a: Float32Array, k: int) -> npt.NDArray[np.int64]:
    """``largest_k`` by a full stable sort of each row (few columns, or NaN present)."""
    return np.argsort(-a, axis=1, kind="stable")[:, :k].astype(np.int64)


def similarity_blocks(z: Float32Array, ZT: Float32Array) -> Iterator[tuple[int, Float32Array]]:
    """``z @ ZT`` in ``SIM_BLOCK_ROWS``-row products (the last one zero-padded): yields each
    block's first row and its rows of the product. Row ``i`` does not depend on the other
    rows of ``z`` (module docstring). The yielded array is reused for the next block."""
    n = z.shape[0]
    out: Float32Array = np.empty((SIM_BLOCK_ROWS, ZT.shape[1]), dtype=np.float32)
    block = np.zeros((SIM_BLOCK_ROWS, z.shape[1]), dtype=np.float32)
    for start in range(0, n, SIM_BLOCK_ROWS):
        rows = min(SIM_BLOCK_ROWS, n - start)
        if rows == SIM_BLOCK_ROWS:
            np.matmul(z[start : start + rows], ZT, out=out)
        else:
            block[:rows] = z[start : start + rows]
            block[rows:] = 0.0
            np.matmul(block, ZT, out=out)
        yield start, out[:rows]


def block_similarity(z: Float32Array, ZT: Float32Array) -> Float32Array:
    """``z @ ZT`` computed ``SIM_BLOCK_ROWS`` rows at a time (``similarity_blocks``)."""
    out: Float32Array = np.empty((z.shape[0], ZT.shape[1]), dtype=np.float32)
    for start, sim in similarity_blocks(z, ZT):
        out[start : start + len(sim)] = sim
    return out


class KNNEstimator:
    name = "knn"

    def __init__(
        self, k: int = 48, semantic_dims: int | None = None, prior_weight: float = 1.0
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.semantic_dims = semantic_dims
        self.prior_weight = prior_weight  # pseudo-count of the replicate's per-model mean
        self.Z: Float32Array | None = None
        self.Y: npt.NDArray[np.float32] | None = None
        self.M: npt.NDArray[np.float32] | None = None
        self.W: npt.NDArray[np.float32] | None = None  # [B, n_train]
        self.prior: npt.NDArray[np.float32] | None = None  # [B, m]
        self._ZT: Float32Array | None = None  # Z transposed, contiguous (the product's right side)
        self._YM: npt.NDArray[np.float32] | None = None  # Y * M, the masked scores

    def _z(self, X: Float32Array) -> Float32Array:
        d = self.semantic_dims or X.shape[1]
        z = np.ascontiguousarray(X[:, :d], dtype=np.float32)
        norm = np.linalg.norm(z, axis=1, keepdims=True)
        out: Float32Array = z / np.maximum(norm, 1e-12)
        return out

    def fit(
        self, X: Float32Array, Y: FloatArray, n_replicates: int = 20, seed: int = 0
    ) -> KNNEstimator:
        X, Yz, mask = check_xy(X, Y)
        self.Z = self._z(X)
        self._ZT = None
        self._YM = None
        self.Y = Yz.astype(np.float32)
        self.M = mask.astype(np.float32)
        W = bootstrap_weights(X.shape[0], n_replicates, seed)
        self.W = W.astype(np.float32)
        num = W @ (Yz * mask)
        den = W @ mask
        self.prior = (num / np.maximum(den, 1e-9)).astype(np.float32)
        return self

    def predict_replicates(self, X: Float32Array) -> npt.NDArray[np.float32]:
        if (
            self.Z is None
            or self.Y is None
            or self.M is None
            or self.W is None
            or self.prior is None
        ):
            raise RuntimeError("KNNEstimator: fit() before predict")
        z = self._z(X)
        if self._ZT is None:
            self._ZT = np.ascontiguousarray(self.Z.T)
        if self._YM is None or self._YM.shape != self.Y.shape:
            self._YM = self.Y * self.M  # gathered once per window below, not Y and M apart
        n, k = len(z), min(self.k, self._ZT.shape[1])
        pw = np.float32(self.prior_weight)
        prior = pw * self.prior[:, None, :]
        out: npt.NDArray[np.float32] = np.empty((len(self.W), n, self.Y.shape[1]), np.float32)
        # each block of rows start to end while its similarities are in cache: neighbours,
        # then the replicates' weighted averages (row by row, as over the whole window)
        for start, sim in similarity_blocks(z, self._ZT):
            idx = largest_k(sim, k)  # [r, k]
            s = np.maximum(np.take_along_axis(sim, idx, axis=1), 0.0) + 1e-3
            # [r, B, k] view of the weights: the batched product ``np.einsum("bnk,nkm->bnm",
            # optimize=True)`` makes, without its per-call path search
            w = (self.W[:, idx] * s[None]).transpose(1, 0, 2)
            num = np.matmul(w, self._YM[idx]).transpose(1, 0, 2)  # [B, r, m]; Y·M, masked
            den = np.matmul(w, self.M[idx]).transpose(1, 0, 2)
            out[:, start : start + len(idx)] = (num + prior) / (den + pw)
        return out

    def state(self) -> tuple[dict[str, Any], Arrays]:
        assert self.Z is not None and self.Y is not None and self.M is not None
        assert self.W is not None and self.prior is not None
        params = {
            "k": self.k,
            "semantic_dims": self.semantic_dims,
            "prior_weight": self.prior_weight,
        }
        arrays: Arrays = {"Z": self.Z, "Y": self.Y, "M": self.M, "W": self.W, "prior": self.prior}
        return params, arrays

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: Arrays) -> KNNEstimator:
        e = cls(
            k=int(params["k"]),
            semantic_dims=params["semantic_dims"],
            prior_weight=float(params["prior_weight"]),
        )
        e.Z, e.Y, e.M, e.W, e.prior = (arrays[k] for k in ("Z", "Y", "M", "W", "prior"))
        return e
