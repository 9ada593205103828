"""Quality predictors: estimators, bootstrap, conformal coverage, artefact (routing/quality/)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from routing.datasets import RoutingData, split_by_query
from routing.quality import (
    ArtefactError,
    QualityPredictor,
    bootstrap_weights,
    conformal_kappa,
    coverage,
    make_estimator,
    predictor_from_bytes,
    train_predictor,
)
from routing.quality.evaluate import (
    evaluate_predictor,
    evaluate_routing,
    lambda_for_budget,
    route_per_query,
)

# OpenBLAS threads busy-wait: one BLAS thread for this module (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_blas_thread")


TASK_WORDS = {
    "math": "compute the sum integral derivative fraction equation solve value".split(),
    "history": "king empire dynasty war century ruled battle treaty".split(),
    "code": "python function return list loop variable compile test".split(),
}
# true success probability of each model on each task (rows: tasks, cols: models)
P_TRUE = np.array([[0.9, 0.3, 0.5, 0.2], [0.2, 0.8, 0.5, 0.3], [0.5, 0.5, 0.9, 0.1]])
MODELS = ["mathy", "historian", "coder", "tiny"]


def synthetic(n: int, seed: int) -> tuple[RoutingData, np.ndarray]:
    """Queries from 3 tasks, Bernoulli scores with known per-(task, model) probability."""
    rng = np.random.default_rng(seed)
    names = list(TASK_WORDS)
    task_idx = rng.integers(0, 3, n)
    texts = []
    for i, t in enumerate(task_idx):
        words = rng.choice(TASK_WORDS[names[t]], 6)
        texts.append(f"q{seed}-{i}: " + " ".join(words) + f" {rng.integers(0, 1000)}?")
    p = P_TRUE[task_idx]
    scores = (rng.random(p.shape) < p).astype(np.float64)
    m = len(MODELS)
    data = RoutingData(
        query_ids=[f"{seed}-{i}" for i in range(n)],
        tasks=[names[t] for t in task_idx],
        texts=texts,
        models=list(MODELS),
        scores=scores,
        input_usd_per_token=np.array([1e-6, 1e-6, 2e-6, 1e-7]),
        output_usd_per_token=np.array([2e-6, 2e-6, 4e-6, 2e-7]),
        prompt_tokens=np.full(n, 20, dtype=np.int64),
        output_tokens=np.full((n, m), np.nan),
        cost_usd=np.full((n, m), np.nan),
    )
    return data, p


@pytest.fixture(scope="module")
def synth() -> tuple[RoutingData, RoutingData, np.ndarray]:
    data, p = synthetic(900, seed=1)
    test, p_test = synthetic(500, seed=2)
    return data, test, p_test


@pytest.fixture(scope="module")
def trained(synth: tuple[RoutingData, RoutingData, np.ndarray]) -> dict[str, QualityPredictor]:
    data = synth[0]
    small = {
        "knn": {"k": 15},
        "gbdt": {"n_trees": 50, "num_threads": 1},
        "irt": {"n_traits": 3, "max_iter": 80},
    }
    return {
        name: train_predictor(data, name, n_replicates=8, level=0.8, seed=0, estimator_kwargs=kw)
        for name, kw in small.items()
    }


def test_bootstrap_weights_resample_whole_queries() -> None:
    w = bootstrap_weights(50, 20, seed=3)
    assert w.shape == (20, 50)
    np.testing.assert_array_equal(w.sum(axis=1), 50)
    assert (w == 0).any()  # some queries are out of bag
    np.testing.assert_array_equal(bootstrap_weights(5, 1, 0), np.ones((1, 5)))


def test_conformal_kappa_known_answer() -> None:
    scores = np.arange(1, 10, dtype=float)  # 9 scores
    assert conformal_kappa(scores, 0.5) == 5.0  # ceil(10 * 0.5) = 5th smallest
    assert conformal_kappa(scores, 0.9) == 9.0
    assert conformal_kappa(scores, 0.95) == 9.0  # too few points: the largest
    with pytest.raises(ValueError, match="level must be in"):
        conformal_kappa(scores, 1.0)


@pytest.mark.parametrize("name", ["knn", "gbdt", "irt"])
def test_estimators_recover_known_probabilities(
    name: str,
    synth: tuple[RoutingData, RoutingData, np.ndarray],
    trained: dict[str, QualityPredictor],
) -> None:
    _, test, p_test = synth
    est = trained[name].predict(test.texts)
    assert est.mean.shape == est.lower.shape == (test.n, len(MODELS))
    assert np.abs(est.mean - p_test).mean() < 0.12
    assert (est.lower <= est.mean).all()
    assert (est.std >= 0).all()
    # routing on the estimate picks the truly best model for most queries
    assert (est.mean.argmax(1) == p_test.argmax(1)).mean() > 0.9


@pytest.mark.parametrize("name", ["knn", "gbdt", "irt"])
@pytest.mark.parametrize("level", [0.7, 0.8, 0.9])
def test_interval_coverage_matches_nominal(
    name: str,
    level: float,
    synth: tuple[RoutingData, RoutingData, np.ndarray],
    trained: dict[str, QualityPredictor],
) -> None:
    _, test, _ = synth
    pred = trained[name].with_level(level)
    est = pred.predict(test.texts)
    assert abs(coverage(est.lower, test.scores) - level) <= 0.05


@pytest.mark.parametrize("name", ["knn", "gbdt", "irt"])
def test_artefact_round_trip_gives_identical_predictions(
    name: str,
    synth: tuple[RoutingData, RoutingData, np.ndarray],
    trained: dict[str, QualityPredictor],
) -> None:
    _, test, _ = synth
    pred = trained[name]
    again = predictor_from_bytes(pred.to_bytes())
    a, b = pred.predict(test.texts[:100]), again.predict(test.texts[:100])
    # to float32 rounding: ``pred``'s memo holds predictions made in other windows, and BLAS
    # may round a row by its position in the product (tests/routing/test_quality_memo.py)
    np.testing.assert_allclose(a.mean, b.mean, rtol=0, atol=1e-6)
    np.testing.assert_allclose(a.lower, b.lower, rtol=0, atol=1e-6)
    assert again.models == pred.models and again.level == pred.level
    np.testing.assert_array_equal(
        again.length.predict(test.texts[:5], test.prompt_tokens[:5]),
        pred.length.predict(test.texts[:5], test.prompt_tokens[:5]),
    )
    assert (
        again.seen(pred_texts := test.texts[:3]).tolist()
        == pred.seen(pred_texts).tolist()
        == [False] * 3
    )


@pytest.mark.parametrize("name", ["knn", "gbdt", "irt"])
def test_empty_window_gives_empty_estimate(name: str, trained: dict[str, QualityPredictor]) -> None:
    est = trained[name].predict([])
    assert est.mean.shape == est.lower.shape == (0, len(MODELS))


def test_artefact_version_and_format_are_checked(trained: dict[str, QualityPredictor]) -> None:
    with np.load(io.BytesIO(trained["knn"].to_bytes())) as npz:
        arrays = {k: npz[k] for k in npz.files}
    header = json.loads(bytes(arrays["header"]).decode())
    header["version"] = 999
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    future = io.BytesIO()
    np.savez(future, **arrays)
    with pytest.raises(ArtefactError, match="future.npz: artefact version 999"):
        predictor_from_bytes(future.getvalue(), "future.npz")
    with pytest.raises(ArtefactError, match="junk.npz: not a predictor artefact"):
        predictor_from_bytes(b"not a zip", "junk.npz")
    header_less = io.BytesIO()
    np.savez(header_less, x=np.zeros(1))
    with pytest.raises(ArtefactError, match="no header"):
        predictor_from_bytes(header_less.getvalue())


def test_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="unknown estimator 'forest'"):
        make_estimator("forest")


def test_training_queries_are_flagged_as_seen(
    synth: tuple[RoutingData, RoutingData, np.ndarray], trained: dict[str, QualityPredictor]
) -> None:
    data, test, _ = synth
    pred = trained["knn"]
    assert pred.seen(data.texts).all()
    assert not pred.seen(test.texts).any()
    tr, te = split_by_query(data, 0.3, seed=0)
    assert not set(tr.texts) & set(te.texts)


def test_lambda_bisection_keeps_predicted_spend_within_budget() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((300, 5))
    c = rng.random((300, 5)) * np.array([1, 2, 4, 8, 16])
    rows = np.arange(300)
    for budget in (c.min(1).sum() * 1.01, c.sum() / 10, c.max(1).sum()):
        lam = lambda_for_budget(a, c, budget)
        pick = route_per_query(a, c, lam)
        assert c[rows, pick].sum() <= budget + 1e-9
        if lam > 0:  # a smaller lambda would overspend: the budget binds
            assert c[rows, route_per_query(a, c, lam * 0.98)].sum() > budget * 0.9
    assert lambda_for_budget(a, c, c.max(1).sum() * 10) == 0.0


def test_evaluate_routing_reference_figures() -> None:
    scores = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    cost = np.array([[1.0, 10.0]] * 3)
    rep = evaluate_routing(scores, scores, scores, cost, cost, ["cheap", "dear"], (0.5, 1.0))
    assert rep["oracle_quality"] == 1.0
    assert rep["best_single_model"] == "dear"
    assert rep["best_single_model_quality"] == pytest.approx(2 / 3)
    assert rep["best_single_model_cost_usd"] == 30.0
    full = rep["budgets"][1]
    assert full["point"]["quality"] == 1.0  # perfect predictions reach the oracle for 21 of 30
    assert full["point"]["spend_usd"] == 21.0
    # 15: the two identical "dear" queries switch at the same lambda (spend 3 -> 21), so
    # per-query routing with one lambda sends everything cheap: a known limit of the baseline
    half = rep["budgets"][0]
    assert half["point"]["spend_usd"] == 3.0 and half["point"]["quality"] == pytest.approx(1 / 3)


def test_evaluate_predictor_drops_training_queries(
    synth: tuple[RoutingData, RoutingData, np.ndarray], trained: dict[str, QualityPredictor]
) -> None:
    data, test, _ = synth
    rep = evaluate_predictor(trained["gbdt"], test, (0.25, 0.5))
    assert rep["n_queries"] == test.n and rep["n_queries_dropped_seen_in_training"] == 0
    for key in (
        "coverage",
        "nominal_coverage",
        "oracle_quality",
        "best_single_model_quality",
        "budgets",
    ):
        assert key in rep
    for b in rep["budgets"]:
        assert b["point"]["predicted_spend_usd"] <= b["budget_usd"] * (1 + 1e-9)
        assert b["robust"]["predicted_spend_usd"] <= b["budget_usd"] * (1 + 1e-9)
    with pytest.raises(ValueError, match="all 900 queries were used to train"):
        evaluate_predictor(trained["gbdt"], data)
