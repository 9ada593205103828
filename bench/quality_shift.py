"""Robust vs point when the serving-time task mix is unlike the training mix (issue 13).

    .venv/bin/python bench/quality_shift.py                     # ccf20 from ../shared, GBDT
    .venv/bin/python bench/quality_shift.py --estimator knn --rare arc_c,hotpot_qa,squad,math

The 80/20 split of ``bench/quality.py`` (by query, stratified by task, seed 0). The
predictor is trained on the 80% with the ``--rare`` tasks cut to ``--keep`` of their
queries; the traffic served is the held-out queries of the rare tasks plus a quarter as
many of the others. ``--calibration`` of the served queries are labelled and used by
``routing.quality.recalibrate`` to re-select the robust value (no retraining); the rest
are held out. Reported per budget fraction (of the best single model's held-out cost):
realised quality of the point estimate, of the re-selected robust value, and of the
per-model bias bound forced (what the selection rejected or took). Seeds are fixed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline.blas import limit_blas_threads  # noqa: E402
from offline.datasets import load_routing_data  # noqa: E402
from routing.cost import cost_usd  # noqa: E402
from routing.datasets import RoutingData, split_by_query  # noqa: E402
from routing.quality import QualityPredictor, RobustSpec, recalibrate, train_predictor  # noqa: E402
from routing.quality.evaluate import evaluate_routing  # noqa: E402
from routing.quality.robustness import bias_ucb  # noqa: E402
from wiring.paths import shared_data  # noqa: E402

FRACTIONS = (0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 0.9, 1.0)


def _predict(pred: QualityPredictor, d: RoutingData) -> tuple[Any, np.ndarray]:
    X = pred.features(d.texts)
    est = pred.predict_features(X)
    c_hat = cost_usd(
        d.prompt_tokens,
        pred.length.predict_features(d.prompt_tokens, X),
        pred.input_usd_per_token,
        pred.output_usd_per_token,
    )
    return est, c_hat


def run(args: argparse.Namespace) -> dict[str, Any]:
    data = load_routing_data(args.data, args.format)
    train, test = split_by_query(data, 0.2, seed=0)
    rare = args.rare.split(",")
    rng = np.random.default_rng(0)
    tasks = np.array(train.tasks)
    keep = np.flatnonzero(~np.isin(tasks, rare) | (rng.random(len(tasks)) < args.keep))
    pred = train_predictor(train.subset(keep), args.estimator, n_replicates=20, seed=0)
    tt = np.array(test.tasks)
    served = np.flatnonzero(np.isin(tt, rare))
    others = np.flatnonzero(~np.isin(tt, rare))
    served = np.concatenate([served, rng.choice(others, len(served) // 4, replace=False)])
    serve = test.subset(rng.permutation(served))
    cal, hold = split_by_query(serve, 1.0 - args.calibration, seed=1)
    again, sel = recalibrate(pred, cal)
    est_c, _ = _predict(pred, cal)
    forced = RobustSpec(
        "per-model", level=0.5, offset_per_model=tuple(bias_ucb(est_c.mean, cal.scores, 0.5))
    )
    est, c_hat = _predict(pred, hold)
    y, cost = np.nan_to_num(hold.scores), hold.realised_cost_usd()
    chosen = again.robust or RobustSpec()
    out: dict[str, Any] = {
        "data": Path(args.data).name,
        "estimator": args.estimator,
        "rare_tasks": rare,
        "train_queries": int(len(keep)),
        "calibration_queries": cal.n,
        "held_out_queries": hold.n,
        "chosen_on_served_calibration": chosen.label(),
        "candidates": sel.candidates,
        "variants": {},
    }
    for name, spec in (("selected", chosen), ("per-model bias (forced)", forced)):
        rep = evaluate_routing(
            est.mean, spec.lower(est.mean, est.std, pred.s0), y, cost, c_hat, hold.models, FRACTIONS
        )
        out["best_single"] = rep["best_single_model"]
        out["best_single_quality"] = rep["best_single_model_quality"]
        out["variants"][name] = {
            "auc_point": rep["auc_point"],
            "auc_robust": rep["auc_robust"],
            "by_fraction": [
                {
                    "fraction": b["fraction"],
                    "point": b["point"]["quality"],
                    "robust": b["robust"]["quality"],
                    "gain": b["robust_gain"],
                }
                for b in rep["budgets"]
            ],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data", default=str(shared_data("routing", "irt_router_ccf20", "scores.csv.gz"))
    )
    ap.add_argument("--format", default="irt-wide")
    ap.add_argument("--estimator", default="gbdt")
    ap.add_argument("--rare", default="arc_c,hotpot_qa,squad,math")
    ap.add_argument(
        "--keep", type=float, default=0.05, help="share of the rare tasks kept in training"
    )
    ap.add_argument(
        "--calibration", type=float, default=0.4, help="share of served queries labelled"
    )
    args = ap.parse_args()
    limit_blas_threads(1)
    print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
