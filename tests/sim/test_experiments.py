"""Experiment harness: batch ILP vs per-query, allocation, JSON keys (sim/experiments/)."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from offline.datasets import load_routing_data
from routing.features import HashedNgramFeaturizer
from sim import experiments as ex
from sim.traffic import adversarial_order


def _synthetic(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three models: cheap solves easy queries, mid medium, dear nearly all."""
    rng = np.random.default_rng(seed)
    hard = rng.random(n)
    a = np.stack([1 - hard, 1 - 0.6 * hard, 1 - 0.1 * hard], axis=1)
    c = np.array([1.0, 3.0, 10.0])[None, :] * (1 + rng.random((n, 1)))
    return a, c


def test_batch_ilp_meets_budget_and_beats_per_query_at_equal_money() -> None:
    a, c = _synthetic()
    budget = 4.0 * 50
    rng = np.random.default_rng(1)
    batches = ex.make_batches(rng.permutation(a.shape[0]), 50)
    lam = ex.lambda_for_budget(a, c, budget / 50 * a.shape[0])
    ilp = [ex.solve_batch(a[r], c[r], budget) for r in batches]
    hard = [ex.per_query_enforced(a[r], c[r], lam, budget) for r in batches]
    for pick, r in zip(ilp, batches, strict=True):
        assert c[r[pick >= 0], pick[pick >= 0]].sum() <= budget * (1 + 1e-9)
    for pick, r in zip(hard, batches, strict=True):
        assert c[r[pick >= 0], pick[pick >= 0]].sum() <= budget * (1 + 1e-9)
    q_ilp = ex.score_batches(ilp, batches, a, c, budget)
    q_hard = ex.score_batches(hard, batches, a, c, budget)
    assert q_ilp.breaches == 0 and q_hard.breaches == 0
    assert q_ilp.quality >= q_hard.quality


def test_adversarial_batches_make_one_lambda_per_query_routing_break_budgets() -> None:
    a, c = _synthetic(n=800)
    budget = 4.0 * 40
    lam = ex.lambda_for_budget(a, c, budget / 40 * a.shape[0])
    pick = ex.route_per_query(a, c, lam)
    own = c[np.arange(a.shape[0]), pick]
    rng = np.random.default_rng(2)
    rand = ex.make_batches(rng.permutation(a.shape[0]), 40)
    adv = ex.make_batches(adversarial_order(own, 40, rng), 40)
    o_rand = ex.score_batches([pick[r] for r in rand], rand, a, c, budget)
    o_adv = ex.score_batches([pick[r] for r in adv], adv, a, c, budget)
    assert o_adv.spend_usd == pytest.approx(o_rand.spend_usd)  # same queries, same money in total
    assert o_adv.worst_over > o_rand.worst_over
    assert o_adv.per_batch_spend.max() > o_rand.per_batch_spend.max()


def test_allocation_respects_gpus_and_beats_uniform_on_its_windows() -> None:
    a, c = _synthetic(n=240)
    g = np.array([1, 2, 4])
    slots = np.array([20, 20, 20])
    rows = [np.arange(120), np.arange(120, 240)]
    for gpus in (4, 8, 12):
        opt = ex.allocate_counts(a, c, rows, g, slots, gpus)
        uni = ex.uniform_counts(g, gpus)
        assert (opt * g).sum() <= gpus and (uni * g).sum() <= gpus
        q_opt = ex.score_batches(
            ex.route_windows(a, c, rows, opt * slots, float("inf")), rows, a, c, float("inf")
        )
        q_uni = ex.score_batches(
            ex.route_windows(a, c, rows, uni * slots, float("inf")), rows, a, c, float("inf")
        )
        assert q_opt.quality >= q_uni.quality - 1e-9


def _tiny_dataset(tmp: Path, n: int = 260) -> tuple[Path, Path, Path]:
    rng = np.random.default_rng(0)
    words = ["math", "code", "history", "poem", "proof", "sum", "list", "story"]
    models = [("m-small", 1e-7), ("m-mid", 4e-7), ("m-big", 2e-6)]
    data = tmp / "long.csv.gz"
    with gzip.open(data, "wt", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["query_id", "task", "text", "model", "score"])
        for i in range(n):
            k = int(rng.integers(0, len(words)))
            text = f"{words[k]} question {i} " + " ".join(rng.choice(words, 5))
            hard = k / len(words)
            for j, (m, _) in enumerate(models):
                w.writerow(
                    [f"q{i}", words[k], text, m, float(rng.random() < 1 - hard * (1 - 0.4 * j))]
                )
    prices = tmp / "models.csv"
    prices.write_text(
        "model,input_usd_per_token,output_usd_per_token\n"
        + "".join(f"{m},{p},{p}\n" for m, p in models)
    )
    cluster = tmp / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": m,
                        "input_usd_per_token": p,
                        "output_usd_per_token": p,
                        "gpus_per_instance": g,
                        "max_concurrency": 16,
                        "step_time": {
                            "c0_ms": 5.0,
                            "c1_ms_per_token": 0.02,
                            "c2_ms_per_ctx_token": 1e-5,
                            "c3_ms_per_attn_unit": 1e-7,
                        },
                    }
                    for (m, p), g in zip(models, (1, 2, 4), strict=True)
                ],
                "instances": [{"id": f"{m}-0", "model": m} for m, _ in models],
            }
        )
    )
    return data, prices, cluster


def _tiny_inputs(tmp_path: Path, n: int = 260, **kw: Any) -> ex.ExperimentInputs:
    """Quick experiment inputs on ``_tiny_dataset`` (3 replicates, a small featurizer)."""
    data, prices, cluster = _tiny_dataset(tmp_path, n=n)
    return ex.ExperimentInputs(
        data,
        "long",
        prices,
        cluster,
        tmp_path,
        quick=True,
        replicates=3,
        featurizer=HashedNgramFeaturizer(n_buckets=512, rank=8, fit_max_texts=300),
        loader=load_routing_data,
        **kw,
    )


def test_offline_experiments_write_the_issue_json_keys(tmp_path: Path) -> None:
    inputs = _tiny_inputs(tmp_path, estimator="knn")
    b = ex.run("batching", inputs)
    for kind in ("random", "adversarial"):
        assert {"batch", "per_query", "gain"} <= set(b.json[kind])
    assert set(b.json["budget_breaches"]) >= {"batch", "per_query"}
    assert b.json["budget_breaches"]["batch"] == {"random": 0, "adversarial": 0}
    assert b.png.exists()
    al = ex.run("allocation", inputs)
    assert {"gain", "gpus_to_match_best_single", "gpus_best_single"} <= set(al.json)
    assert al.png.exists() and "| GPUs |" in al.markdown()


def test_shifted_mix_cuts_the_tasks_from_training_and_serves_mostly_them(tmp_path: Path) -> None:
    from sim.experiments.robust import shifted_mix

    data = load_routing_data(*_tiny_dataset(tmp_path, n=400)[:1], "long", tmp_path / "models.csv")
    train, test = ex.split(data, 0)
    fit, served = shifted_mix(train, test, ("math", "code"), keep=0.1, seed=0)
    rare_train = sum(t in ("math", "code") for t in train.tasks)
    rare_fit = sum(t in ("math", "code") for t in fit.tasks)
    assert 0 < rare_fit < 0.3 * rare_train  # ~10% kept
    assert fit.n == train.n - (rare_train - rare_fit)
    share = np.mean([t in ("math", "code") for t in served.tasks])
    assert 0.75 < share < 0.85  # the rare tasks plus a quarter as many others
    assert not set(served.texts) & set(fit.texts)  # served queries are held out
    with pytest.raises(ValueError, match="not in the data"):
        shifted_mix(train, test, ("nope",), keep=0.1, seed=0)


@pytest.mark.parametrize("shift", [(), ("math", "code", "history", "poem")])
def test_robust_experiment_reports_every_variant_and_budget(
    tmp_path: Path, shift: tuple[str, ...]
) -> None:
    inputs = _tiny_inputs(tmp_path, n=400, shift=shift)
    r = ex.run("robust", inputs)
    variants = ["point", "selected", "bootstrap_q", "conformal"]
    if shift:
        variants = [
            "point",
            "selected",
            "recalibrated",
            "per-model bias (forced)",
            "per-model affine (oracle)",
        ]
    for est in ("knn", "gbdt", "irt"):
        got = r.json[est]
        assert [b["budget_fraction"] for b in got["by_budget"]] == list(r.json["fractions"])
        for b in got["by_budget"]:
            assert set(variants) <= set(b)
            assert all(0.0 <= b[k] <= 1.0 for k in variants)
        # too few calibration queries to tell candidates apart: the shipped value is the
        # point estimate, which routes exactly like it
        assert got["selected"] == "point"
        assert got["worst_gain_selected"] == 0.0
        if shift:
            assert got["labelled_served_queries"] + got["held_out_served_queries"] > 0
    assert r.png.exists()


def test_oracle_affine_is_the_per_model_least_squares_line() -> None:
    from sim.experiments.robust import oracle_affine

    rng = np.random.default_rng(0)
    mean = rng.random((200, 3))
    y = np.stack([0.1 + 0.5 * mean[:, 0], 0.9 - 0.2 * mean[:, 1], mean[:, 2]], axis=1)
    np.testing.assert_allclose(oracle_affine(mean, y), y, atol=1e-9)
    flat = np.full((10, 1), 0.3)
    np.testing.assert_array_equal(oracle_affine(flat, rng.random((10, 1))), flat)


def test_oracle_quality_returns_each_texts_realised_scores_averaged_over_duplicates() -> None:
    from routing.datasets import RoutingData

    scores = np.array([[1.0, 0.0], [0.0, np.nan], [0.5, 1.0]])
    data = RoutingData(
        query_ids=["a", "b", "c"],
        tasks=["t", "t", "t"],
        texts=["x", "x", "y"],
        models=["m0", "m1"],
        scores=scores,
        input_usd_per_token=np.zeros(2),
        output_usd_per_token=np.zeros(2),
        prompt_tokens=np.ones(3, dtype=np.int64),
        output_tokens=np.ones((3, 2)),
        cost_usd=np.zeros((3, 2)),
    )
    oracle = ex.OracleQuality(data)
    est = oracle.predict(["y", "x"])
    np.testing.assert_allclose(est.mean, [[0.5, 1.0], [0.5, 0.0]])  # nan counts as 0
    np.testing.assert_array_equal(est.lower, est.mean)
    assert (est.std == 0).all()
    with pytest.raises(ex.ExperimentError, match="no score for 1 text"):
        oracle.predict(["z"])


def test_ontime_summary_gains_per_seed_against_the_best_mean_baseline() -> None:
    from sim.experiments.ontime import CURVES, KEYS, PROCESSES, _summarise

    rates = np.array([1.0, 2.0, 3.0])
    level = {  # flat curves: AUC = 2 x level
        "round-robin": [0.5, 0.58],  # better than latency-agnostic on seed 1 only
        "shortest-queue": [0.4, 0.4],
        "latency-agnostic": [0.55, 0.55],
        "latency-aware": [0.6, 0.66],
        "batch-ilp-sfs": [0.65, 0.66],
    }
    runs = {
        p: {
            c: {k: np.tile(np.asarray(level.get(c, [0.9, 0.9]))[:, None], (1, 3)) for k in KEYS}
            for c in CURVES
        }
        for p in PROCESSES
    }
    out, rows = _summarise(runs, rates, [0, 1])
    poisson = out["poisson"]
    assert poisson["best_baseline"] == "latency-agnostic"  # the highest mean AUC
    assert poisson["latency-aware"]["auc"] == pytest.approx(2 * 0.63)
    # per seed: 0.6/0.55 - 1 and 0.66/0.55 - 1
    assert poisson["latency-aware"]["auc_gain_vs_best_baseline"] == pytest.approx(
        (0.6 / 0.55 + 0.66 / 0.55) / 2 - 1
    )
    diff = poisson["batch_ilp_minus_latency_aware"]
    np.testing.assert_allclose(diff["mean"], [0.025] * 3)
    assert diff["ilp_ahead_every_seed"] == [True] * 3
    assert len(rows) == len(PROCESSES) * len(CURVES)
