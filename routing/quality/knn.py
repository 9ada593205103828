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

**Prototypes** (``prototypes > 0``): the training rows' unit vectors are clustered at fit
(``spherical_kmeans``, seeded) into P prototypes, and per prototype p and replicate b the
weighted sums ``num[b, p] = sum_{k in p} w_bk y_k m_k`` and ``den[b, p] = sum_{k in p} w_bk
m_k`` (m the observed mask) are kept. A query scores the P centroids instead of the
training rows and averages over its ``prototype_k`` most similar prototypes:

    q_hat[b, i] = (sum_{p in N(i)} s_ip num[b, p] + c prior_b) / (sum_{p in N(i)} s_ip den[b, p] + c)

with the same clipped similarity and pseudo-count c; ``prototype_k`` 0 (auto) takes the
prototypes that hold ``k`` training rows on average. With one training row per prototype
(``prototypes >= n_train``, auto or ``prototype_k == k``) this is the exact estimator
above, to float32 rounding. The centroids are scored in the same fixed blocks and each
row's weighted sums are a product of its own, so a query still predicts the same alone as
in any window.
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
KMEANS_ITERATIONS = 30  # Lloyd rounds of ``spherical_kmeans`` at most (it stops when stable)


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


def spherical_kmeans(
    Z: Float32Array, n_clusters: int, seed: int, iterations: int = KMEANS_ITERATIONS
) -> tuple[Float32Array, npt.NDArray[np.int64]]:
    """Cluster the unit rows of ``Z`` by cosine similarity: ``(centroids [P, d], labels [n])``
    with unit centroids (each its members' normalised mean) and ``P <= n_clusters`` (clusters
    left empty are dropped, e.g. with fewer distinct rows than clusters). Deterministic for a
    seed: k-means++ seeding on ``1 - cosine``, then Lloyd rounds (each row to its most
    similar centroid, lowest index on ties) until no row moves. ``n_clusters >= n``: one
    cluster per row, the centroids ``Z`` itself, in order (the exact kNN's neighbours)."""
    n = Z.shape[0]
    if n_clusters < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    if n_clusters >= n:
        return np.array(Z, dtype=np.float32), np.arange(n, dtype=np.int64)
    Zd = Z.astype(np.float64)
    rng = np.random.default_rng(seed)
    chosen = [int(rng.integers(n))]
    dist = np.maximum(1.0 - Zd @ Zd[chosen[0]], 0.0)
    for _ in range(1, n_clusters):
        total = dist.sum()
        if total <= 0.0:  # every row equals a chosen one
            break
        nxt = int(np.searchsorted(np.cumsum(dist), rng.random() * total, side="right"))
        nxt = min(nxt, n - 1)
        chosen.append(nxt)
        np.minimum(dist, np.maximum(1.0 - Zd @ Zd[nxt], 0.0), out=dist)
    C = Zd[chosen]
    labels = np.full(n, -1, dtype=np.int64)
    for _ in range(iterations):
        new = np.argmax(Zd @ C.T, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        sums = np.zeros_like(C)
        np.add.at(sums, labels, Zd)
        norm = np.linalg.norm(sums, axis=1, keepdims=True)
        # an empty cluster keeps its centroid (it may take rows in the next round)
        C = np.where(norm > 0.0, sums / np.maximum(norm, 1e-300), C)
    used = np.unique(labels)  # sorted: the kept clusters in their order
    remap = np.full(len(C), -1, dtype=np.int64)
    remap[used] = np.arange(len(used))
    sums = np.zeros((len(used), Z.shape[1]), dtype=np.float64)
    labels = remap[labels]
    np.add.at(sums, labels, Zd)
    centroids = (sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)).astype(
        np.float32
    )
    return centroids, labels


def block_similarity(z: Float32Array, ZT: Float32Array) -> Float32Array:
    """``z @ ZT`` computed ``SIM_BLOCK_ROWS`` rows at a time (``similarity_blocks``)."""
    out: Float32Array = np.empty((z.shape[0], ZT.shape[1]), dtype=np.float32)
    for start, sim in similarity_blocks(z, ZT):
        out[start : start + len(sim)] = sim
    return out


class KNNEstimator:
    name = "knn"

    def __init__(
        self,
        k: int = 48,
        semantic_dims: int | None = None,
        prior_weight: float = 1.0,
        prototypes: int = 0,
        prototype_k: int = 0,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if prototypes < 0:
            raise ValueError(f"prototypes must be >= 0 (0: exact neighbours), got {prototypes}")
        if prototype_k < 0:
            raise ValueError(f"prototype_k must be >= 0 (0: auto), got {prototype_k}")
        self.k = k
        self.semantic_dims = semantic_dims
        self.prior_weight = prior_weight  # pseudo-count of the replicate's per-model mean
        self.prototypes = prototypes  # P clusters of the training rows; 0: exact neighbours
        # prototypes each query averages over; 0: as many as hold k training rows on average
        self.prototype_k = prototype_k
        self.C: Float32Array | None = None  # [P, d] unit centroids (prototypes only)
        self.labels: npt.NDArray[np.int64] | None = None  # [n_train] prototype of each row
        self._CT: Float32Array | None = None  # C transposed, contiguous
        self._T: npt.NDArray[np.float32] | None = None  # [P, 2 * B * m]: num, then den
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
        self.C, self.labels, self._CT, self._T = None, None, None, None
        if self.prototypes:
            self.C, self.labels = spherical_kmeans(self.Z, self.prototypes, seed)
        return self

    def _prototype_table(self) -> npt.NDArray[np.float32]:
        """``[P, 2 * B * m]``: per prototype, its replicates' sums of w·y·m, then of w·m
        (module docstring), summed in float64 and kept in float32."""
        assert self.C is not None and self.labels is not None
        assert self.Y is not None and self.M is not None and self.W is not None
        wt = self.W.T.astype(np.float64)[:, :, None]  # [n, B, 1]
        both = np.concatenate(
            [wt * (self.Y * self.M).astype(np.float64)[:, None, :], wt * self.M[:, None, :]],
            axis=1,
        )  # [n, 2B, m]
        table = np.zeros((len(self.C),) + both.shape[1:], dtype=np.float64)
        np.add.at(table, self.labels, both)
        return np.ascontiguousarray(table.reshape(len(self.C), -1), dtype=np.float32)

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
        if self.C is not None:
            return self._predict_prototypes(z)
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

    def prototypes_per_query(self) -> int:
        """The prototypes a query averages over: ``prototype_k``, or when 0 the number that
        hold ``k`` training rows on average, ``round(k P / n_train)`` (``k`` itself with one
        row per prototype); at least 1, at most P."""
        assert self.C is not None and self.W is not None
        P = len(self.C)
        kp = self.prototype_k or round(self.k * P / self.W.shape[1])
        return max(1, min(kp, P))

    def _predict_prototypes(self, z: Float32Array) -> npt.NDArray[np.float32]:
        """``predict_replicates`` over the prototypes (module docstring)."""
        assert self.C is not None and self.W is not None and self.prior is not None
        if self._CT is None:
            self._CT = np.ascontiguousarray(self.C.T)
        if self._T is None:
            self._T = self._prototype_table()
        n, B, m = len(z), len(self.W), self.prior.shape[1]
        kp = self.prototypes_per_query()
        pw = np.float32(self.prior_weight)
        prior = pw * self.prior  # [B, m]
        out: npt.NDArray[np.float32] = np.empty((B, n, m), np.float32)
        for start, sim in similarity_blocks(z, self._CT):
            idx = largest_k(sim, kp)  # [r, kp]
            s = np.maximum(np.take_along_axis(sim, idx, axis=1), 0.0) + 1e-3
            # [r, 1, kp] @ [r, kp, 2Bm]: each row its own product, whatever the block's rows
            both = np.matmul(s[:, None, :], self._T[idx]).reshape(len(idx), 2, B, m)
            out[:, start : start + len(idx)] = ((both[:, 0] + prior) / (both[:, 1] + pw)).transpose(
                1, 0, 2
            )
        return out

    def state(self) -> tuple[dict[str, Any], Arrays]:
        assert self.Z is not None and self.Y is not None and self.M is not None
        assert self.W is not None and self.prior is not None
        params = {
            "k": self.k,
            "semantic_dims": self.semantic_dims,
            "prior_weight": self.prior_weight,
            "prototypes": self.prototypes,
            "prototype_k": self.prototype_k,
        }
        arrays: Arrays = {"Z": self.Z, "Y": self.Y, "M": self.M, "W": self.W, "prior": self.prior}
        if self.C is not None and self.labels is not None:
            arrays["C"], arrays["labels"] = self.C, self.labels
        return params, arrays

    @classmethod
    def from_state(cls, params: dict[str, Any], arrays: Arrays) -> KNNEstimator:
        e = cls(
            k=int(params["k"]),
            semantic_dims=params["semantic_dims"],
            prior_weight=float(params["prior_weight"]),
            prototypes=int(params.get("prototypes", 0)),  # absent: an artefact of exact kNN
            prototype_k=int(params.get("prototype_k", 0)),
        )
        e.Z, e.Y, e.M, e.W, e.prior = (arrays[k] for k in ("Z", "Y", "M", "W", "prior"))
        if e.prototypes:
            if "C" not in arrays or "labels" not in arrays:
                raise ValueError("a prototype kNN artefact without its centroids and labels")
            e.C = np.ascontiguousarray(arrays["C"], dtype=np.float32)
            e.labels = np.asarray(arrays["labels"], dtype=np.int64)
            if e.labels.shape != (len(e.Z),) or not 0 <= e.labels.min() <= e.labels.max() < len(
                e.C
            ):
                raise ValueError("prototype labels that do not match the training rows")
        return e
