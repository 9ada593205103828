"""Predictor artefact files (loaders/predictor.py): written atomically, read back to the
same predictions; a missing or unreadable file is an ArtefactError naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loaders.predictor import load_predictor, save_predictor
from routing.datasets import RoutingData
from routing.quality import ArtefactError, QualityPredictor, train_predictor

pytestmark = pytest.mark.usefixtures("one_blas_thread")


@pytest.fixture(scope="module")
def pred() -> QualityPredictor:
    rng = np.random.default_rng(0)
    n = 120
    words = ["alpha", "beta", "gamma", "delta"]
    data = RoutingData(
        query_ids=[f"q{i}" for i in range(n)],
        tasks=[""] * n,
        texts=[f"query {i} {words[i % 4]} {words[(i // 4) % 4]}" for i in range(n)],
        models=["a", "b"],
        scores=rng.uniform(0, 1, (n, 2)),
        input_usd_per_token=np.array([1e-5, 1e-6]),
        output_usd_per_token=np.array([1e-5, 1e-6]),
        prompt_tokens=np.full(n, 10, dtype=np.int64),
        output_tokens=np.full((n, 2), np.nan),
        cost_usd=np.full((n, 2), np.nan),
    )
    return train_predictor(data, "knn", n_replicates=3, seed=0, estimator_kwargs={"k": 5})


def test_saved_file_loads_to_the_same_predictions(pred: QualityPredictor, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "p.npz"
    save_predictor(pred, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["p.npz"]  # no temporary left
    assert path.read_bytes() == pred.to_bytes()
    again = load_predictor(path)
    texts = ["query 3 delta alpha", "an unseen text"]
    np.testing.assert_allclose(again.predict(texts).mean, pred.predict(texts).mean, atol=1e-6)
    assert again.models == pred.models


def test_missing_and_junk_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ArtefactError, match=r"absent\.npz: no such predictor file"):
        load_predictor(tmp_path / "absent.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ArtefactError, match=r"junk\.npz: not a predictor artefact"):
        load_predictor(tmp_path / "junk.npz")
