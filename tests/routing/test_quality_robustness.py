"""Robustness selection (routing/quality/robustness.py): the point estimate unless a
bound routes better on calibration queries; per-model bias bounds; the artefact keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loaders.predictor import load_predictor, save_predictor
from routing.datasets import RoutingData
from routing.quality import (
    QualityPredictor,
    RobustSpec,
    recalibrate,
    select_robustness,
    train_predictor,
)
from routing.quality.evaluate import evaluate_routing
from routing.quality.robustness import MAX_LOSS_SHARE_PER_BUDGET, affine_fit, bias_ucb

pytestmark = pytest.mark.usefixtures("one_blas_thread")


def test_spec_formulas_and_json_round_trip() -> None:
    mean = np.array([[0.8, 0.5], [0.4, 0.6]])
    std = np.array([[0.1, 0.0], [0.2, 0.1]])
    np.testing.assert_array_equal(RobustSpec().lower(mean, std, 0.05), mean)
    np.testing.assert_allclose(RobustSpec("std", kappa=2.0).lower(mean, std, 0.05), mean - 2 * std)
    np.testing.assert_allclose(
        RobustSpec("conformal", kappa=2.0, level=0.9).lower(mean, std, 0.05),
        mean - 2 * (std + 0.05),
    )
    pm = RobustSpec("per-model", kappa=1.0, level=0.5, offset_per_model=(0.1, -0.2))
    np.testing.assert_allclose(pm.lower(mean, std, 0.05), mean - std - np.array([0.1, -0.2]))
    assert RobustSpec.from_json(json.loads(json.dumps(pm.to_json()))) == pm
    with pytest.raises(ValueError, match="robust kind must be one of"):
        RobustSpec("wide")
    with pytest.raises(ValueError, match="needs offset_per_model"):
        RobustSpec("per-model")
    with pytest.raises(ValueError, match="kappa must be >= 0"):
        RobustSpec("std", kappa=-1.0)
    with pytest.raises(ValueError, match="2 per-model offsets, the predictor 3 models"):
        pm.lower(np.zeros((1, 3)), np.zeros((1, 3)), 0.0)


def test_bias_ucb_known_answer() -> None:
    mean = np.full((100, 2), 0.7)
    y = np.zeros((100, 2))
    y[:70, 0] = 1.0  # model 0 unbiased (70% success at 0.7 predicted)
    y[:40, 1] = 1.0  # model 1 runs 0.3 high
    b = bias_ucb(mean, y, 0.5, prior_n=0.0)
    np.testing.assert_allclose(b, [0.0, 0.3], atol=1e-12)
    assert (bias_ucb(mean, y, 0.9, prior_n=0.0) > b).all()  # a higher level marks down more
    shrunk = bias_ucb(mean, y, 0.5, prior_n=100.0)
    np.testing.assert_allclose(shrunk, [0.0, 0.15], atol=1e-12)


def _world(n: int, seed: int, bias: float) -> dict[str, np.ndarray]:
    """Three models: an expensive strong one, two cheap ones; the predictor is right
    about all but cheap model 1, which it believes ``bias`` better than it is."""
    rng = np.random.default_rng(seed)
    p = np.column_stack(
        [rng.uniform(0.7, 0.95, n), rng.uniform(0.1, 0.9, n), rng.uniform(0.1, 0.9, n)]
    )
    y = (rng.random(p.shape) < p).astype(float)
    mean = p + rng.normal(0, 0.05, p.shape)
    mean[:, 1] += bias
    std = rng.uniform(0.01, 0.05, p.shape)  # pure noise: says nothing about the error
    cost = np.tile([10.0, 1.0, 1.0], (n, 1)) * 1e-4
    return {"p": p, "y": y, "mean": mean, "std": std, "cost": cost}


def test_selection_keeps_the_point_estimate_when_the_spread_is_noise() -> None:
    w = _world(1500, seed=1, bias=0.0)
    sel = select_robustness(w["mean"], w["std"], w["y"], w["cost"], w["cost"], s0=0.03)
    assert sel.spec == RobustSpec()
    assert sel.report()["label"] == "point"
    assert len(sel.candidates) > 5 and sel.candidates[0]["label"] == "point"


def test_selection_corrects_a_biased_model_and_gains_on_fresh_queries() -> None:
    cal = _world(1500, seed=2, bias=0.3)
    sel = select_robustness(cal["mean"], cal["std"], cal["y"], cal["cost"], cal["cost"], s0=0.03)
    assert sel.spec.kind == "per-model"
    off = np.asarray(sel.spec.offset_per_model)
    assert off[1] > 0.2 and abs(off[0]) < 0.05 and abs(off[2]) < 0.05
    test = _world(3000, seed=3, bias=0.3)
    lower = sel.spec.lower(test["mean"], test["std"], 0.03)
    rep = evaluate_routing(
        test["mean"], lower, test["y"], test["cost"], test["cost"], ["a", "b", "c"], (0.2, 0.4)
    )
    assert all(b["robust_gain"] > 0.02 for b in rep["budgets"])
    assert rep["auc_robust"] > rep["auc_point"]


def test_too_few_or_unpriced_calibration_queries_keep_the_point_estimate() -> None:
    w = _world(150, seed=4, bias=0.3)  # biased, but too few queries to show it
    few = select_robustness(w["mean"], w["std"], w["y"], w["cost"], w["cost"], 0.03)
    assert few.spec == RobustSpec() and "too few" in few.candidates[0]["note"]
    w = _world(200, seed=4, bias=0.3)
    nan_cost = np.full_like(w["cost"], np.nan)
    sel = select_robustness(w["mean"], w["std"], w["y"], nan_cost, nan_cost, 0.03)
    assert sel.spec == RobustSpec() and "no prices" in sel.candidates[0]["note"]


def _routing_data(w: dict[str, np.ndarray], tag: str) -> RoutingData:
    n, m = w["y"].shape
    words = ["alpha", "beta", "gamma", "delta"]
    return RoutingData(
        query_ids=[f"{tag}{i}" for i in range(n)],
        tasks=[""] * n,
        texts=[f"{tag} {i} {words[i % 4]} {words[(i // 4) % 4]}" for i in range(n)],
        models=["a", "b", "c"],
        scores=w["y"],
        input_usd_per_token=np.array([1e-5, 1e-6, 1e-6]),
        output_usd_per_token=np.array([1e-5, 1e-6, 1e-6]),
        prompt_tokens=np.full(n, 10, dtype=np.int64),
        output_tokens=np.full((n, m), np.nan),
        cost_usd=np.full((n, m), np.nan),
    )


@pytest.fixture(scope="module")
def small_pred() -> QualityPredictor:
    return train_predictor(
        _routing_data(_world(300, seed=5, bias=0.0), "fit"),
        "knn",
        n_replicates=4,
        seed=0,
        estimator_kwargs={"k": 10},
    )


def test_trained_predictor_stores_the_selection_and_round_trips(
    small_pred: QualityPredictor, tmp_path: Path
) -> None:
    sel = small_pred.meta["robust_selection"]
    assert sel["chosen"] == small_pred.robust.to_json()  # type: ignore[union-attr]
    save_predictor(small_pred, tmp_path / "p.npz")
    again = load_predictor(tmp_path / "p.npz")
    assert again.robust == small_pred.robust
    texts = ["fit 1 beta alpha", "new query"]
    np.testing.assert_array_equal(again.predict(texts).lower, small_pred.predict(texts).lower)


def test_version_1_artefact_routes_on_its_conformal_bound(
    small_pred: QualityPredictor, tmp_path: Path
) -> None:
    save_predictor(small_pred, tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    header = json.loads(bytes(arrays["header"]).decode())
    header["version"] = 1
    del header["robust"]
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(tmp_path / "v1.npz", **arrays)
    old = load_predictor(tmp_path / "v1.npz")
    assert old.robust == RobustSpec("conformal", kappa=old.kappa, level=old.level)
    est = old.predict(["some text"])
    np.testing.assert_allclose(est.lower, old.conformal_lower(est))


def test_explicit_robust_choices(small_pred: QualityPredictor) -> None:
    lvl = small_pred.with_level(0.8)
    assert lvl.robust is not None and lvl.robust.kind == "conformal" and lvl.robust.level == 0.8
    est = small_pred.with_robust(RobustSpec()).predict(["x y"])
    np.testing.assert_array_equal(est.lower, est.mean)
    with pytest.raises(ValueError, match="robust must be auto, conformal, point"):
        train_predictor(_routing_data(_world(50, 6, 0.0), "z"), "knn", n_replicates=2, robust="max")


def test_recalibrate_on_served_traffic(small_pred: QualityPredictor) -> None:
    served = _routing_data(_world(400, seed=7, bias=0.0), "served")
    again, sel = recalibrate(small_pred, served)
    assert again.robust == sel.spec and again.meta["recalibrated_on_queries"] == 400
    assert sel.spec == RobustSpec()  # the predictor is unbiased on this traffic
    with pytest.raises(ValueError, match="needs >= 20"):
        recalibrate(small_pred, _routing_data(_world(300, seed=5, bias=0.0), "fit"))


@pytest.mark.parametrize("bias", [0.0, 0.1, 0.3])
def test_no_admissible_candidate_loses_at_a_budget_in_over_the_allowed_share(bias: float) -> None:
    w = _world(1500, seed=5, bias=bias)
    sel = select_robustness(w["mean"], w["std"], w["y"], w["cost"], w["cost"], s0=0.03)
    for c in sel.candidates[1:]:
        assert len(c["gain_by_budget"]) == len(c["p_worse_by_budget"]) == 20
        if c["admissible"]:
            assert max(c["p_worse_by_budget"]) <= MAX_LOSS_SHARE_PER_BUDGET
    chosen = [c for c in sel.candidates if c["label"] == sel.spec.label()]
    assert chosen and chosen[0]["admissible"]


def test_a_stricter_loss_share_rejects_the_candidate_that_lost_too_often() -> None:
    w = _world(1500, seed=2, bias=0.3)
    args = (w["mean"], w["std"], w["y"], w["cost"], w["cost"], 0.03)
    loose = select_robustness(*args, max_loss_share=0.5)
    assert loose.spec.kind == "per-model"
    won = next(c for c in loose.candidates if c["label"] == loose.spec.label())
    worst = won["p_worse_at_worst_budget"]
    strict = select_robustness(*args, max_loss_share=worst - 1e-9)
    assert strict.spec.label() != loose.spec.label()
    again = next(c for c in strict.candidates if c["label"] == loose.spec.label())
    assert not again["admissible"]
    assert select_robustness(*args, max_loss_share=-1.0).spec == RobustSpec()  # none can pass


def test_affine_fit_recovers_a_per_model_line_and_shrinks_to_identity() -> None:
    rng = np.random.default_rng(0)
    mean = rng.uniform(0.2, 0.8, (4000, 2))
    y = np.column_stack([0.1 + 0.5 * mean[:, 0], mean[:, 1]]) + rng.normal(0, 0.05, (4000, 2))
    off, scale = affine_fit(mean, y)
    np.testing.assert_allclose([-off[0], scale[0]], [0.1, 0.5], atol=0.02)
    np.testing.assert_allclose([-off[1], scale[1]], [0.0, 1.0], atol=0.02)
    off, scale = affine_fit(mean[:3], y[:3], prior_n=1e6)  # no evidence: the identity
    np.testing.assert_allclose(off, 0.0, atol=1e-3)
    np.testing.assert_allclose(scale, 1.0, atol=1e-3)
    spec = RobustSpec("per-model-affine", offset_per_model=(0.1, 0.0), scale_per_model=(2.0, 1.0))
    np.testing.assert_allclose(
        spec.lower(np.array([[0.5, 0.5]]), np.zeros((1, 2)), 0.0), [[0.9, 0.5]]
    )
    assert RobustSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ValueError, match="offsets and scales"):
        RobustSpec("per-model-affine", offset_per_model=(0.1,))
