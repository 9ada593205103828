"""The prototype kNN (routing/quality/knn.py, ``prototypes > 0``): spherical k-means at fit,
per-prototype replicate sums, the exact estimator as its one-row-per-prototype case, the
block-shape rule (a query alone as in any window), determinism and the artefact."""

from __future__ import annotations

import io

import numpy as np
import pytest

from routing.quality import ArtefactError, predictor_from_bytes, train_predictor
from routing.quality.knn import KNNEstimator, largest_k, spherical_kmeans
from tests.routing.test_quality import synthetic

pytestmark = pytest.mark.usefixtures("one_blas_thread")

PRED_ATOL = 1e-6  # float32 rounding (tests/routing/test_quality_memo.py)


def _xy(n: int, d: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((12, d))
    X = (centres[rng.integers(0, 12, n)] + 0.4 * rng.standard_normal((n, d))).astype(np.float32)
    Y = (rng.random((n, m)) < 0.5).astype(np.float64)
    Y[rng.random((n, m)) < 0.15] = np.nan  # unobserved pairs
    return X, Y


def _queries(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


@pytest.mark.parametrize(("semantic_dims", "prototype_k"), [(None, 20), (10, 20), (None, 0)])
def test_one_row_per_prototype_is_the_exact_estimator(
    semantic_dims: int | None, prototype_k: int
) -> None:
    X, Y = _xy(700, 16, 5, seed=0)
    X[5] = X[4]  # duplicated rows stay prototypes of their own
    exact = KNNEstimator(k=20, semantic_dims=semantic_dims).fit(X, Y, 6, seed=1)
    per_row = KNNEstimator(
        k=20, semantic_dims=semantic_dims, prototypes=len(X) + 50, prototype_k=prototype_k
    ).fit(X, Y, 6, seed=1)
    assert per_row.prototypes_per_query() == 20  # auto: k itself with one row per prototype
    assert per_row.C is not None and per_row.labels is not None
    np.testing.assert_array_equal(per_row.C, exact.Z)
    np.testing.assert_array_equal(per_row.labels, np.arange(len(X)))
    q = np.vstack([_queries(150, 16, seed=2), X[:20]])
    a, b = exact.predict_replicates(q), per_row.predict_replicates(q)
    assert a.shape == b.shape == (6, len(q), 5)
    np.testing.assert_allclose(b, a, rtol=0, atol=PRED_ATOL)


def test_prototype_prediction_is_the_formula() -> None:
    X, Y = _xy(500, 12, 4, seed=3)
    est = KNNEstimator(prototypes=40, prototype_k=7, prior_weight=2.0).fit(X, Y, 5, seed=0)
    assert est.C is not None and est.labels is not None and est.W is not None
    assert est.prior is not None
    q = _queries(90, 12, seed=4)
    got = est.predict_replicates(q)
    z = q / np.linalg.norm(q, axis=1, keepdims=True)
    sim = (z @ est.C.T).astype(np.float32)
    idx = largest_k(sim, 7)
    mask = ~np.isnan(Y)
    Yz = np.where(mask, Y, 0.0)
    P = len(est.C)
    onehot = np.zeros((P, len(X)))
    onehot[est.labels, np.arange(len(X))] = 1.0
    for b in range(5):
        num = onehot @ (est.W[b][:, None] * Yz * mask)  # [P, m]
        den = onehot @ (est.W[b][:, None] * mask)
        for i in range(len(q)):
            s = np.maximum(sim[i, idx[i]], 0.0) + 1e-3
            want = (s @ num[idx[i]] + 2.0 * est.prior[b]) / (s @ den[idx[i]] + 2.0)
            np.testing.assert_allclose(got[b, i], want, rtol=1e-5, atol=1e-5)


def test_a_query_predicts_the_same_alone_as_in_any_window() -> None:
    X, Y = _xy(900, 16, 6, seed=5)
    est = KNNEstimator(prototypes=64, prototype_k=5).fit(X, Y, 8, seed=0)
    q = np.vstack([_queries(150, 16, seed=6), np.zeros((1, 16), np.float32), X[:3]])
    window = est.predict_replicates(q)
    perm = np.random.default_rng(0).permutation(len(q))
    np.testing.assert_allclose(est.predict_replicates(q[perm]), window[:, perm], atol=PRED_ATOL)
    for i in range(len(q)):
        alone = est.predict_replicates(q[i : i + 1])
        np.testing.assert_allclose(alone[:, 0], window[:, i], rtol=0, atol=PRED_ATOL)


def test_fit_is_deterministic_for_a_seed() -> None:
    X, Y = _xy(800, 16, 5, seed=7)
    a = KNNEstimator(prototypes=50, prototype_k=6).fit(X, Y, 4, seed=3)
    b = KNNEstimator(prototypes=50, prototype_k=6).fit(X, Y, 4, seed=3)
    c = KNNEstimator(prototypes=50, prototype_k=6).fit(X, Y, 4, seed=4)
    assert a.C is not None and b.C is not None and c.C is not None
    np.testing.assert_array_equal(a.C, b.C)
    np.testing.assert_array_equal(a.labels, b.labels)  # type: ignore[arg-type]
    q = _queries(70, 16, seed=8)
    np.testing.assert_array_equal(a.predict_replicates(q), b.predict_replicates(q))
    assert a.C.shape != c.C.shape or not np.array_equal(a.C, c.C)  # the seed matters


def test_spherical_kmeans_clusters() -> None:
    X, _ = _xy(600, 8, 1, seed=9)
    Z = X / np.linalg.norm(X, axis=1, keepdims=True)
    C, labels = spherical_kmeans(Z, 12, seed=0)
    assert C.dtype == np.float32 and C.shape == (12, 8)
    np.testing.assert_allclose(np.linalg.norm(C, axis=1), 1.0, rtol=1e-6)
    assert set(labels.tolist()) == set(range(12))  # no empty cluster
    for p in range(12):  # each centroid its members' normalised mean
        mean = Z[labels == p].astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(C[p], mean / np.linalg.norm(mean), atol=1e-6)
    # converged: (nearly) every row is in the cluster of its most similar centroid
    assert (np.argmax(Z @ C.T, axis=1) == labels).mean() > 0.99
    # 5 distinct rows asked for 8 clusters: the empty ones are dropped
    few = np.repeat(Z[:5], 20, axis=0)
    C2, labels2 = spherical_kmeans(few, 8, seed=0)
    assert len(C2) == 5 and sorted(set(labels2.tolist())) == list(range(5))
    with pytest.raises(ValueError):
        spherical_kmeans(Z, 0, seed=0)


def test_prototypes_per_query() -> None:
    X, Y = _xy(600, 8, 2, seed=10)
    auto = KNNEstimator(k=48, prototypes=100).fit(X, Y, 3, seed=0)
    assert auto.C is not None and len(auto.C) == 100
    assert auto.prototypes_per_query() == 8  # round(48 * 100 / 600)
    assert KNNEstimator(k=2, prototypes=100).fit(X, Y, 3, 0).prototypes_per_query() == 1
    assert KNNEstimator(prototypes=10, prototype_k=30).fit(X, Y, 3, 0).prototypes_per_query() == 10
    assert KNNEstimator(prototypes=100, prototype_k=3).fit(X, Y, 3, 0).prototypes_per_query() == 3


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        KNNEstimator(prototypes=-1)
    with pytest.raises(ValueError):
        KNNEstimator(prototype_k=-1)


def test_artefact_round_trip() -> None:
    data, _ = synthetic(500, seed=11)
    pred = train_predictor(
        data,
        "knn",
        n_replicates=6,
        seed=0,
        estimator_kwargs={"prototypes": 48, "prototype_k": 5},
    )
    again = predictor_from_bytes(pred.to_bytes())
    e0, e1 = pred.estimator, again.estimator
    assert (e1.prototypes, e1.prototype_k) == (48, 5)
    np.testing.assert_array_equal(e1.C, e0.C)
    np.testing.assert_array_equal(e1.labels, e0.labels)
    test, _ = synthetic(80, seed=12)
    X = pred.features(test.texts)
    np.testing.assert_array_equal(
        e1.predict_replicates(X), e0.predict_replicates(X)
    )  # the same arrays: the per-prototype sums rebuilt from them alike
    a, b = pred.predict(test.texts), again.predict(test.texts)
    np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=PRED_ATOL)
    # an artefact of exact kNN (no prototype fields) still loads as exact kNN
    params, arrays = KNNEstimator().fit(X, np.ones((len(X), 2)), 2, seed=0).state()
    old = KNNEstimator.from_state(
        {k: v for k, v in params.items() if not k.startswith("prototype")}, arrays
    )
    assert old.prototypes == 0 and old.C is None
    # a prototype artefact without its centroids is refused
    with np.load(io.BytesIO(pred.to_bytes())) as npz:
        kept = {k: npz[k] for k in npz.files if k != "est__C"}
    buf = io.BytesIO()
    np.savez(buf, **kept)
    with pytest.raises(ArtefactError, match="centroids"):
        predictor_from_bytes(buf.getvalue())
    params, arrays = e0.state()
    arrays["labels"] = np.full_like(arrays["labels"], len(arrays["C"]))  # no such prototype
    with pytest.raises(ValueError, match="labels"):
        KNNEstimator.from_state(params, arrays)
