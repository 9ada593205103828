"""Offline evaluation of a quality predictor on held-out queries (issue 4).

Per-query routing under a budget (paper B's per-query baseline): each query i goes to

    j*(i) = argmax_j  a_ij - lambda * c_hat_ij

with ``a`` either the point estimate (bootstrap mean) or the robust lower bound, and
``c_hat`` the *predicted* cost. ``lambda`` is found by bisection as the smallest value
whose predicted spend fits the budget. Budgets are fractions of the (realised) cost of
sending every query to the best single model. Reported: realised mean score and
realised spend of both variants, the oracle (best model per query), the best single
model, and the area under the quality-vs-budget curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from routing.types import FloatArray, IntArray


def route_per_query(a: FloatArray, c_hat: FloatArray, lam: float) -> IntArray:
    """``argmax_j a_ij - lam * c_hat_ij`` per row (ties -> cheaper, then lower index)."""
    u = a - lam * c_hat
    best = u.max(axis=1, keepdims=True)
    tied = u >= best - 1e-12
    c = np.where(tied, c_hat, np.inf)
    out: IntArray = c.argmin(axis=1).astype(np.int64)
    return out


def lambda_for_budget(
    a: FloatArray, c_hat: FloatArray, budget_usd: float, iters: int = 60
) -> float:
    """Smallest ``lambda >= 0`` (to bisection precision) with predicted spend <= budget.

    If even the cheapest model per query breaks the budget, returns the ``lambda``
    that routes everything to the cheapest model (the least spend reachable)."""
    rows = np.arange(a.shape[0])

    def spend(lam: float) -> float:
        return float(c_hat[rows, route_per_query(a, c_hat, lam)].sum())

    if spend(0.0) <= budget_usd:
        return 0.0
    spread_a = float(np.nanmax(a) - np.nanmin(a)) + 1e-9
    positive = c_hat[c_hat > 0]
    min_gap = float(positive.min()) if positive.size else 1.0
    hi = spread_a / max(min_gap, 1e-18)
    for _ in range(200):
        if spend(hi) <= budget_usd:
            break
        hi *= 2.0
    lo = 0.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if spend(mid) <= budget_usd:
            hi = mid
        else:
            lo = mid
    return hi


def routed_outcome(
    a: FloatArray, c_hat: FloatArray, scores: FloatArray, cost: FloatArray, budget_usd: float
) -> dict[str, float]:
    lam = lambda_for_budget(a, c_hat, budget_usd)
    pick = route_per_query(a, c_hat, lam)
    rows = np.arange(a.shape[0])
    return {
        "quality": float(np.nanmean(scores[rows, pick])),
        "spend_usd": float(cost[rows, pick].sum()),
        "predicted_spend_usd": float(c_hat[rows, pick].sum()),
        "lambda": lam,
        "feasible": bool(c_hat[rows, pick].sum() <= budget_usd * (1 + 1e-9)),
    }


def evaluate_routing(
    mean: FloatArray,
    lower: FloatArray,
    scores: FloatArray,
    cost: FloatArray,
    c_hat: FloatArray,
    models: Sequence[str],
    budget_fractions: Sequence[float] = (0.1, 0.25, 0.5),
    curve_points: int = 20,
    extra: dict[str, FloatArray] | None = None,
) -> dict[str, Any]:
    """Point vs robust per-query routing at each budget fraction, plus reference figures.

    ``extra`` adds more routing variants by name (same budgets).
    ``scores`` and ``cost`` are realised ``[n, m]`` values (``scores`` may hold nan for
    pairs that were not evaluated; those count as missing in the means)."""
    mean_by_model = np.nanmean(scores, axis=0)
    best = int(np.nanargmax(mean_by_model))
    best_cost = float(cost[:, best].sum())
    out: dict[str, Any] = {
        "n_queries": int(scores.shape[0]),
        "oracle_quality": float(np.nanmean(np.nanmax(scores, axis=1))),
        "best_single_model": models[best],
        "best_single_model_quality": float(mean_by_model[best]),
        "best_single_model_cost_usd": best_cost,
        "cheapest_model_quality": float(mean_by_model[int(np.argmin(cost.sum(axis=0)))]),
        "budgets": [],
    }
    for f in budget_fractions:
        budget = f * best_cost
        point = routed_outcome(mean, c_hat, scores, cost, budget)
        robust = routed_outcome(lower, c_hat, scores, cost, budget)
        gain = (
            (robust["quality"] - point["quality"]) / point["quality"]
            if point["quality"] > 0
            else float("nan")
        )
        out["budgets"].append(
            {
                "fraction": float(f),
                "budget_usd": budget,
                "point": point,
                "robust": robust,
                "robust_gain": gain,
                **{
                    name: routed_outcome(a, c_hat, scores, cost, budget)
                    for name, a in (extra or {}).items()
                },
            }
        )
    grid = np.linspace(0.05, 1.0, curve_points)
    curves: dict[str, list[float]] = {"fraction": grid.tolist(), "point": [], "robust": []}
    for f in grid:
        curves["point"].append(routed_outcome(mean, c_hat, scores, cost, f * best_cost)["quality"])
        curves["robust"].append(
            routed_outcome(lower, c_hat, scores, cost, f * best_cost)["quality"]
        )
    width = float(grid[-1] - grid[0])
    out["curve"] = curves
    out["auc_point"] = float(np.trapezoid(curves["point"], grid) / width)
    out["auc_robust"] = float(np.trapezoid(curves["robust"], grid) / width)
    return out


def evaluate_predictor(
    predictor: Any,
    data: Any,
    budget_fractions: Sequence[float] = (0.1, 0.25, 0.5),
    exclude_seen: bool = True,
) -> dict[str, Any]:
    """The ``switchyard eval-quality`` report for a ``QualityPredictor`` on ``RoutingData``.

    Queries whose text the predictor saw in training are dropped (``exclude_seen``), so
    evaluating on the training file measures the held-out queries only."""
    from routing.cost import cost_usd
    from routing.quality.calibration import coverage

    missing = [mdl for mdl in predictor.models if mdl not in data.models]
    if missing:
        raise ValueError(
            f"the data has no scores for predictor model(s) {missing}; data models: {data.models}"
        )
    data = data.select_models(predictor.models)
    if np.isnan(data.input_usd_per_token).any() or np.isnan(data.output_usd_per_token).any():
        raise ValueError("the data has no per-model prices; pass a models CSV (--models-csv)")
    n_all = data.n
    n_seen = 0
    if exclude_seen:
        seen = predictor.seen(data.texts)
        n_seen = int(seen.sum())
        if n_seen == n_all:
            raise ValueError(
                f"all {n_all} queries were used to train this predictor; evaluate on other data "
                "or retrain with a held-out fraction (switchyard train --test-fraction)"
            )
        data = data.subset(np.flatnonzero(~seen))
    X = predictor.features(data.texts)
    est = predictor.predict_features(X)
    raw_lower = predictor.bootstrap_lower(X)
    out_tok = predictor.length.predict_features(data.prompt_tokens, X)
    c_hat = cost_usd(
        data.prompt_tokens, out_tok, predictor.input_usd_per_token, predictor.output_usd_per_token
    )
    prior = np.where(np.isnan(data.output_tokens), out_tok, data.output_tokens)
    realised = data.cost_usd.copy()
    formula = cost_usd(
        data.prompt_tokens, prior, data.input_usd_per_token, data.output_usd_per_token
    )
    realised = np.where(np.isnan(realised), formula, realised)
    report = evaluate_routing(
        est.mean,
        est.lower,
        data.scores,
        realised,
        c_hat,
        data.models,
        budget_fractions,
        extra={"robust_uncalibrated": raw_lower},
    )
    known = ~np.isnan(data.output_tokens)
    length_mae = (
        float(np.abs(out_tok[known] - data.output_tokens[known]).mean()) if known.any() else None
    )
    ok = ~np.isnan(data.scores)
    head = {
        "estimator": predictor.meta.get("estimator", predictor.estimator.name),
        "featurizer": predictor.meta.get("featurizer", predictor.featurizer.name),
        "n_replicates": int(predictor.meta.get("n_replicates", 0)),
        "n_queries": data.n,
        "n_queries_dropped_seen_in_training": n_seen,
        "coverage": coverage(predictor.conformal_lower(est), data.scores),
        "nominal_coverage": float(predictor.level),
        "robust": predictor.robust.label(),
        "coverage_robust_value": coverage(est.lower, data.scores),
        "coverage_uncalibrated_bootstrap": coverage(raw_lower, data.scores),
        "kappa": float(predictor.kappa),
        "mae_mean": float(np.abs(est.mean - data.scores)[ok].mean()),
        "output_length_mae_tokens": length_mae,
        "cost_note": data.meta.get("cost_note", ""),
    }
    head.update({k: v for k, v in report.items() if k != "n_queries"})
    return head
