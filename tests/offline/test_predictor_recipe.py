"""The default predictor's recipe (offline/predictor.py): its knn settings reach training and
its cache key."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import routing.quality
from offline.predictor import DEFAULT_RECIPE, cache_key, train


class _Stop(Exception):
    pass


def _kwargs_of(recipe: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    seen: dict[str, Any] = {}

    def fake(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(routing.quality, "train_predictor", fake)
    with pytest.raises(_Stop):
        train(recipe)
    return seen["estimator_kwargs"]


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
