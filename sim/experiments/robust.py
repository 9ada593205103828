"""``robust`` (paper B, "Robustness"): batch ILP on robust values vs on the point
estimate, per estimator (kNN, GBDT, IRT), at budget fractions 0.05–1.0 (paper B: +1–14%).

Two settings:

- *matched mix* (default): train on 70% of the queries (by query, stratified by task),
  serve the other 30%. The robust value the product ships (``selected``) is the one
  ``train_predictor`` chose on its own calibration queries (``routing.quality.robustness``).
- *shifted mix* (``ExperimentInputs.shift``, CLI ``--shift TASK,...``): the predictor is
  trained with those tasks cut to ``shift_keep`` of their training queries, and serves a
  mix made of the held-out queries of those tasks plus a quarter as many of the others.
  ``shift_labelled`` of the served queries are labelled: ``routing.quality.recalibrate``
  re-selects the robust value on them (no retraining); routing is scored on the rest only,
  so no choice ever sees the queries it is scored on.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from routing.datasets import RoutingData, split_by_query
from routing.quality import RobustSpec, recalibrate
from routing.quality.robustness import bias_ucb
from routing.types import FloatArray
from sim import report
from sim.experiments.common import (
    ExperimentError,
    ExperimentInputs,
    ExperimentResult,
    Progress,
    finish,
    load_data,
    make_batches,
    offline,
    predict_offline,
    replicates,
    score_batches,
    solve_batch,
    split,
)

FULL_FRACTIONS = tuple(round(0.05 * k, 2) for k in range(1, 21))
QUICK_FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)


def shifted_mix(
    train: RoutingData, test: RoutingData, rare: tuple[str, ...], keep: float, seed: int
) -> tuple[RoutingData, RoutingData]:
    """(training queries with the ``rare`` tasks cut to ``keep`` of theirs, served mix:
    the held-out ``rare`` queries plus a quarter as many of the others, shuffled)."""
    unknown = sorted(set(rare) - set(train.tasks))
    if unknown:
        raise ValueError(
            f"shift tasks {unknown} are not in the data (tasks: {sorted(set(train.tasks))})"
        )
    rng = np.random.default_rng(seed)
    tasks = np.asarray(train.tasks, dtype=object)
    kept = np.flatnonzero(~np.isin(tasks, rare) | (rng.random(train.n) < keep))
    tt = np.asarray(test.tasks, dtype=object)
    served = np.flatnonzero(np.isin(tt, rare))
    others = np.flatnonzero(~np.isin(tt, rare))
    extra = rng.choice(others, min(len(others), len(served) // 4), replace=False)
    served = rng.permutation(np.concatenate([served, extra]))
    return train.subset(kept), test.subset(served)


def oracle_affine(mean: FloatArray, y: FloatArray) -> FloatArray:
    """``α_j + β_j · mean_ij`` with ``(α_j, β_j)`` the least-squares fit of ``y`` on
    ``mean`` per model (``[n, m]``): how much any per-model correction could gain."""
    out = mean.copy()
    for j in range(mean.shape[1]):
        x = mean[:, j]
        if np.ptp(x) > 0:
            beta, alpha = np.polyfit(x, y[:, j], 1)
            out[:, j] = alpha + beta * x
    return out


def _variants(
    inputs: ExperimentInputs, est: str
) -> tuple[Any, dict[str, FloatArray], dict[str, Any]]:
    """The held-out predictions and the values each variant routes on."""
    data = load_data(inputs)
    train, test = split(data, inputs.seed)
    n_rep = replicates(inputs)
    if not inputs.shift:
        off = offline(train, test, est, n_rep, inputs.seed, featurizer=inputs.featurizer)
        pred = off.predictor
        values = {
            "point": off.mean,
            "selected": off.lower,
            "bootstrap_q": off.boot_lower,
            "conformal": off.mean - pred.kappa * (off.std + pred.s0),
        }
        info: dict[str, Any] = {"selected": (pred.robust or RobustSpec()).label()}
        return off, values, info
    fit, served = shifted_mix(train, test, inputs.shift, inputs.shift_keep, inputs.seed)
    labelled, held = split_by_query(served, 1.0 - inputs.shift_labelled, seed=inputs.seed + 1)
    off = offline(fit, held, est, n_rep, inputs.seed, featurizer=inputs.featurizer)
    pred = off.predictor
    again, _ = recalibrate(pred, labelled, seed=inputs.seed)
    lab = predict_offline(pred, labelled)
    forced = RobustSpec(
        "per-model", level=0.5, offset_per_model=tuple(bias_ucb(lab.mean, labelled.scores, 0.5))
    )
    values = {
        "point": off.mean,
        "selected": off.lower,  # chosen on the training mix's calibration queries
        "recalibrated": (again.robust or RobustSpec()).lower(off.mean, off.std, pred.s0),
        "per-model bias (forced)": forced.lower(off.mean, off.std, pred.s0),
        # a bound, not a method: the best per-model affine correction of the point
        # estimate, fitted on the very queries it is scored on
        "per-model affine (oracle)": oracle_affine(off.mean, off.scores),
    }
    info = {
        "selected": (pred.robust or RobustSpec()).label(),
        "recalibrated": (again.robust or RobustSpec()).label(),
        "train_queries": fit.n,
        "labelled_served_queries": labelled.n,
        "held_out_served_queries": held.n,
    }
    return off, values, info


def run_robust(inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    """Point vs robust values in paper B's batch ILP, per estimator and budget.

    Budgets are fractions of the predicted cost of the best single model (by held-out
    realised quality) on a batch. ``selected``: the robust value the predictor ships;
    ``bootstrap_q``: paper B's bound, the (1 − level) quantile of the bootstrap replicates;
    ``conformal``: issue 4's calibrated bound mean − κ·(std + s0) at level 0.9. Shifted
    mix: ``recalibrated`` (re-selected on labelled served queries), the per-model bias
    bound forced (what that selection took or rejected), and an oracle bound on any
    per-model correction (``oracle_affine``, fitted on the scored queries themselves)."""
    t0 = time.perf_counter()
    estimators = ("knn", "gbdt", "irt")
    batch_size = 64 if inputs.quick else 128
    fractions = QUICK_FRACTIONS if inputs.quick else FULL_FRACTIONS
    out: dict[str, Any] = {"shift": list(inputs.shift), "fractions": list(fractions)}
    rows: list[dict[str, Any]] = []
    names: list[str] = []
    for est in estimators:
        off, values, info = _variants(inputs, est)
        names = list(values)
        rng = np.random.default_rng(inputs.seed)
        batches = make_batches(rng.permutation(off.test.n), batch_size)
        q = off.scores.mean(axis=0)
        j_best = int(np.argmax(q))
        if not float(off.c_hat[:, j_best].sum()) > 0:
            raise ExperimentError(
                "the predictor has no per-token prices (predicted cost 0): pass a models CSV "
                "with prices (--models-csv); the batch ILP needs predicted costs"
            )
        per_budget = []
        for frac in fractions:
            budget = frac * float(off.c_hat[:, j_best].mean()) * batch_size
            res: dict[str, float] = {}
            done: list[tuple[FloatArray, float]] = []
            for kind, a in values.items():
                same = [r for v, r in done if np.array_equal(v, a)]
                if same:  # identical values route identically: no second solve
                    res[kind] = same[0]
                    continue
                picks = [solve_batch(a[r], off.c_hat[r], budget) for r in batches]
                res[kind] = score_batches(picks, batches, off.scores, off.cost, budget).quality
                done.append((a, res[kind]))
            gains = {
                f"gain {k}": (res[k] - res["point"]) / max(res["point"], 1e-12) for k in names[1:]
            }
            per_budget.append({"budget_fraction": frac, **res, **gains})
            rows.append({"estimator": est, "budget": f"{frac:g}", **res, **gains})
            if progress:
                progress(
                    f"robust {est} budget {frac:g}: "
                    + " ".join(f"{k} {v:.4f}" for k, v in res.items())
                )
        out[est] = {
            **info,
            "best_single": off.test.models[j_best],
            "best_single_quality": float(q[j_best]),
            "n_queries": off.test.n,
            "worst_gain_selected": min(r["gain selected"] for r in per_budget),
            "by_budget": per_budget,
            "level": off.predictor.level,
        }
        if inputs.shift:
            out[est]["worst_gain_recalibrated"] = min(r["gain recalibrated"] for r in per_budget)
    png = report.plot_panels(
        {
            est: (list(fractions), {k: [r[k] for r in out[est]["by_budget"]] for k in names})
            for est in estimators
        },
        inputs.png("robust"),
        xlabel="budget (fraction of the best single model's cost)"
        + (f"; served mix: {', '.join(inputs.shift)}" if inputs.shift else ""),
        ylabel="realised mean quality",
        highlight=("selected", "recalibrated"),
    )
    cols = [("estimator", "estimator"), ("budget", "budget (x best single)")]
    for k in names:
        cols.append((k, k))
    for k in names[1:]:
        cols.append((f"gain {k}", f"gain {k}"))
    return finish("robust", out, rows, cols, png, t0, pct=tuple(f"gain {k}" for k in names[1:]))
