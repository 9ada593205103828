"""The default predictor's recipe (offline/predictor.py): its knn and featurizer settings
reach training and its cache key."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import routing.quality
from offline.predictor import DEFAULT_RECIPE, cache_key, train
from routing.features import HashedNgramFeaturizer


class _Stop(Exception):
    pass


def _call_of(recipe: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[Any, ...], Any]:
    seen: list[tuple[tuple[Any, ...], Any]] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        raise _Stop

    monkeypatch.setattr(routing.quality, "train_predictor", fake)
    with pytest.raises(_Stop):
        train(recipe)
    return seen[0]


def _kwargs_of(recipe: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    return _call_of(recipe, monkeypatch)[1]["estimator_kwargs"]


def test_knn_prototypes_reach_training(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_RECIPE.estimator == "knn" and DEFAULT_RECIPE.prototypes == 1024
    assert _kwargs_of(DEFAULT_RECIPE, monkeypatch) == {"prototypes": 1024, "prototype_k": 0}
    exact = replace(DEFAULT_RECIPE, prototypes=0)
    assert _kwargs_of(exact, monkeypatch) == {"prototypes": 0, "prototype_k": 0}
    assert _kwargs_of(replace(DEFAULT_RECIPE, estimator="irt"), monkeypatch) is None


def test_prototypes_change_the_cache_key() -> None:
    keys = {
        cache_key(DEFAULT_RECIPE),
        cache_key(replace(DEFAULT_RECIPE, prototypes=0)),
        cache_key(replace(DEFAULT_RECIPE, prototype_k=5)),
    }
    assert len(keys) == 3


def test_featurizer_settings_reach_training(monkeypatch: pytest.MonkeyPatch) -> None:
    feat = _call_of(DEFAULT_RECIPE, monkeypatch)[0][2]
    assert isinstance(feat, HashedNgramFeaturizer)
    want = (
        DEFAULT_RECIPE.ngram_widths,
        DEFAULT_RECIPE.feature_rank,
        DEFAULT_RECIPE.projection_dtype,
    )
    assert (feat.ngram_widths, feat.rank, feat.projection_dtype) == want
    other = replace(
        DEFAULT_RECIPE, ngram_widths=(3, 4), feature_rank=32, projection_dtype="float64"
    )
    feat = _call_of(other, monkeypatch)[0][2]
    assert (feat.ngram_widths, feat.rank, feat.projection_dtype) == ((3, 4), 32, "float64")
    assert feat.n_buckets == HashedNgramFeaturizer().n_buckets


def test_featurizer_settings_change_the_cache_key() -> None:
    keys = {
        cache_key(DEFAULT_RECIPE),
        cache_key(replace(DEFAULT_RECIPE, ngram_widths=(3, 4))),
        cache_key(replace(DEFAULT_RECIPE, feature_rank=32)),
        cache_key(replace(DEFAULT_RECIPE, projection_dtype="float64")),
    }
    assert len(keys) == 4
