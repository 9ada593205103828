"""``robust`` (paper B, "Robustness"): batch ILP on the lower bound vs on the point
estimate, per estimator (kNN, GBDT, IRT), at tight budgets (paper B: +1–14%)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sim import report
from sim.experiments.common import (
    ExperimentInputs,
    ExperimentResult,
    Progress,
    best_single,
    finish,
    load_data,
    make_batches,
    offline,
    replicates,
    score_batches,
    solve_batch,
    split,
)


def run_robust(inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    """Point vs robust values in paper B's batch ILP, per estimator and budget.

    ``robust``: paper B's bound, the (1 − level) quantile of the bootstrap replicates
    (epistemic spread only); ``robust_conformal``: routing.quality's calibrated lower bound
    (mean − κ·(std + s0), coverage-calibrated on held-out scores)."""
    t0 = time.perf_counter()
    data = load_data(inputs)
    train, test = split(data, inputs.seed)
    estimators = ("knn", "gbdt", "irt")
    batch_size = 64 if inputs.quick else 128
    fractions = (0.1, 0.25) if inputs.quick else (0.05, 0.1, 0.2, 0.3)
    rng = np.random.default_rng(inputs.seed)
    out: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    order = rng.permutation(test.n)
    batches = make_batches(order, batch_size)
    for est in estimators:
        off = offline(
            train, test, est, replicates(inputs), inputs.seed, featurizer=inputs.featurizer
        )
        j_best, _, _ = best_single(off.scores, off.cost)
        per_budget = []
        for frac in fractions:
            budget = frac * float(off.c_hat[:, j_best].mean()) * batch_size
            res: dict[str, float] = {}
            for kind, a in (
                ("point", off.mean),
                ("robust", off.boot_lower),
                ("robust_conformal", off.lower),
            ):
                picks = [solve_batch(a[r], off.c_hat[r], budget) for r in batches]
                res[kind] = score_batches(picks, batches, off.scores, off.cost, budget).quality
            gain = res["robust"] / max(res["point"], 1e-12) - 1
            gain_c = res["robust_conformal"] / max(res["point"], 1e-12) - 1
            per_budget.append(
                {"budget_fraction": frac, **res, "gain": gain, "gain_conformal": gain_c}
            )
            rows.append(
                {
                    "estimator": est,
                    "budget": f"{frac:.0%} of best single",
                    **res,
                    "gain": gain,
                    "gain_conformal": gain_c,
                }
            )
            if progress:
                progress(
                    f"robust {est} budget {frac:.0%}: point {res['point']:.4f} robust {res['robust']:.4f} "
                    f"conformal {res['robust_conformal']:.4f}"
                )
        best = max(per_budget, key=lambda r: r["gain"])
        out[est] = {
            "point": best["point"],
            "robust": best["robust"],
            "gain": best["gain"],
            "budget_fraction": best["budget_fraction"],
            "mean_gain": float(np.mean([r["gain"] for r in per_budget])),
            "robust_conformal": best["robust_conformal"],
            "gain_conformal": best["gain_conformal"],
            "by_budget": per_budget,
            "level": off.predictor.level,
        }
    png = report.plot_bars(
        [r["estimator"] + " " + r["budget"].split()[0] for r in rows],
        {
            "point": [r["point"] for r in rows],
            "robust (bootstrap quantile)": [r["robust"] for r in rows],
            "robust (conformal)": [r["robust_conformal"] for r in rows],
        },
        inputs.png("robust"),
        ylabel="realised mean quality",
        title="Batch ILP on robust lower bounds vs point estimates",
    )
    cols = [
        ("estimator", "estimator"),
        ("budget", "budget"),
        ("point", "point"),
        ("robust", "robust (bootstrap q10)"),
        ("gain", "gain"),
        ("robust_conformal", "robust (conformal)"),
        ("gain_conformal", "gain"),
    ]
    return finish("robust", out, rows, cols, png, t0, pct=("gain", "gain_conformal"))
