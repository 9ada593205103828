"""Benchmark of the quality predictors (issue 4, item 7).

    .venv/bin/python bench/quality.py --quick            # < 60 s: vendored dc9 only, JSON on stdout
    .venv/bin/python bench/quality.py --out /tmp/q.json  # full: dc9, ccf20 and nq6 (when ../shared exists)
    .venv/bin/python bench/quality.py --markdown /tmp/q.json   # the tables of docs/benchmarks/quality.md

Per dataset and estimator (knn, gbdt, irt; bootstrap B = 20): a split by query (80%
train, 20% held out, stratified by task, seed 0), ``routing.quality.train_predictor``
on the train part (it keeps 20% of it for the conformal calibration), then
``routing.quality.evaluate.evaluate_predictor`` on the held-out queries: coverage of
the robust lower bound against its nominal level, point vs robust per-query routing at
budgets that are fractions of the cost of the best single model, the area under the
quality-vs-budget curve (fractions 0.05..1), the oracle and the best single model.
Robustness sweep: the same predictor at several nominal levels. Speed: predicting 1,024
queries x 20 models with features given (median of repeated calls), and featurisation
throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offline.blas import limit_blas_threads  # noqa: E402
from offline.datasets import load_routing_data  # noqa: E402
from routing.datasets import RoutingData, split_by_query  # noqa: E402
from routing.features import make_featurizer  # noqa: E402
from routing.quality import train_predictor  # noqa: E402
from routing.quality.evaluate import evaluate_predictor  # noqa: E402
from wiring.paths import shared_data, vendored_data  # noqa: E402

FRACTIONS = (0.1, 0.15, 0.25, 0.5)


def datasets(quick: bool) -> list[tuple[str, RoutingData]]:
    out = [
        (
            "dc9",
            load_routing_data(
                vendored_data("routing", "llmrouter_dc9", "scores_long.csv.gz"), "long"
            ),
        )
    ]
    if quick:
        return out
    ccf = shared_data("routing", "irt_router_ccf20", "scores.csv.gz")
    if ccf.exists():
        out.append(("ccf20", load_routing_data(ccf, "irt-wide")))
    nq = shared_data("routing", "llmrouter_nq6", "nq_router_records.jsonl")
    if nq.exists():
        prices = vendored_data("routing", "llmrouter_nq6", "models.csv")
        out.append(("nq6", load_routing_data(nq, "nq-records", prices)))
    return out


def _median_ms(fn: Any, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


def speed(pred: Any, texts: list[str], repeats: int) -> dict[str, float]:
    """Predict 1,024 queries with features given; featurisation throughput."""
    batch = (texts * (1024 // max(len(texts), 1) + 1))[:1024]
    t = time.perf_counter()
    X = pred.features(batch)
    feat_s = time.perf_counter() - t
    return {
        "predict_1024_ms": _median_ms(lambda: pred.predict_features(X), repeats),
        "n_models": len(pred.models),
        "featurise_texts_per_s": 1024 / feat_s,
    }


def speed_20_models(
    estimators: list[str],
    texts: list[str],
    replicates: int,
    repeats: int,
    estimator_kwargs: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """The issue's speed case (1,024 x 20 models) even without the 20-model data: dc9 texts
    with 20 synthetic models (scores drawn from Bernoulli(0.2..0.8)); timing only."""
    rng = np.random.default_rng(0)
    n, m = len(texts), 20
    p = rng.uniform(0.2, 0.8, m)
    data = RoutingData(
        query_ids=[str(i) for i in range(n)],
        tasks=[""] * n,
        texts=texts,
        models=[f"model{j}" for j in range(m)],
        scores=(rng.random((n, m)) < p).astype(float),
        input_usd_per_token=np.full(m, 1e-7),
        output_usd_per_token=np.full(m, 1e-7),
        prompt_tokens=np.full(n, 100, dtype=np.int64),
        output_tokens=np.full((n, m), np.nan),
        cost_usd=np.full((n, m), np.nan),
    )
    rows = []
    for est in estimators:
        pred = train_predictor(
            data, est, n_replicates=replicates, seed=0, estimator_kwargs=estimator_kwargs.get(est)
        )
        rows.append(
            {
                "estimator": est,
                "n_train_queries": pred.meta["n_train_queries"],
                **speed(pred, texts, repeats),
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    estimators = args.estimators.split(",")
    report: dict[str, Any] = {
        "quick": args.quick,
        "replicates": args.replicates,
        "level": args.level,
        "budget_fractions": list(FRACTIONS),
        "estimator_kwargs": args.estimator_kwargs,
        "featurizer_kwargs": args.featurizer_kwargs,
        "results": [],
        "level_sweep": [],
    }
    for name, data in datasets(args.quick):
        if args.quick:
            data = split_by_query(data, 0.6, seed=1)[0]  # 40% of dc9 keeps --quick short
        train, _ = split_by_query(data, 0.2, seed=0)
        for feat, est in [(f, e) for f in args.featurizers.split(",") for e in estimators]:
            t = time.perf_counter()
            fkw = args.featurizer_kwargs.get(feat)
            pred = train_predictor(
                train,
                est,
                make_featurizer(feat, **fkw) if fkw else feat,
                n_replicates=args.replicates,
                level=args.level,
                seed=0,
                estimator_kwargs=args.estimator_kwargs.get(est),
            )
            fit_s = time.perf_counter() - t
            rep = evaluate_predictor(pred, data, FRACTIONS)
            curve = rep.pop("curve", None)
            row = {
                "dataset": name,
                "estimator_kwargs": args.estimator_kwargs.get(est, {}),
                "featurizer_kwargs": fkw or {},
                "fit_s": fit_s,
                **rep,
                **speed(pred, data.texts, 3 if args.quick else 9),
            }
            if curve:  # robust minus point at each of the 20 budget fractions 0.05..1
                row["robust_minus_point"] = [
                    r - q for r, q in zip(curve["robust"], curve["point"], strict=True)
                ]
            report["results"].append(row)
            if (
                not args.quick
                and args.sweep
                and feat == "hashed"
                and est == args.sweep_estimator.get(name, "knn")
            ):
                for level in args.sweep_levels:
                    r = evaluate_predictor(pred.with_level(level), data, FRACTIONS)
                    report["level_sweep"].append(
                        {
                            "dataset": name,
                            "estimator": est,
                            "level": level,
                            "coverage": r["coverage"],
                            "kappa": r["kappa"],
                            "auc_point": r["auc_point"],
                            "auc_robust": r["auc_robust"],
                            "budgets": [
                                {
                                    "fraction": b["fraction"],
                                    "point": b["point"]["quality"],
                                    "robust": b["robust"]["quality"],
                                }
                                for b in r["budgets"]
                            ],
                        }
                    )
    if not args.quick:
        dc9 = load_routing_data(
            vendored_data("routing", "llmrouter_dc9", "scores_long.csv.gz"), "long"
        )
        report["speed_20_models"] = speed_20_models(
            estimators, dc9.texts[:3000], args.replicates, 15, args.estimator_kwargs
        )
    report["seconds"] = time.perf_counter() - t0
    return report


def markdown(report: dict[str, Any]) -> str:
    lines: list[str] = []
    lines.append(
        "| dataset | featurizer | estimator | n test | coverage (nominal) | uncalibrated | MAE | AUC point "
        "| AUC robust | robust chosen | worst robust - point | oracle | best single | fit s | predict 1024 ms (m) |"
    )
    lines.append("|" + "---|" * 15)
    for r in report["results"]:
        worst = min(r.get("robust_minus_point", [float("nan")]))
        lines.append(
            f"| {r['dataset']} | {r.get('featurizer', 'hashed')} | {r['estimator']} | {r['n_queries']} "
            f"| {r['coverage']:.3f} ({r['nominal_coverage']:.2f}) "
            f"| {r['coverage_uncalibrated_bootstrap']:.3f} | {r['mae_mean']:.3f} | {r['auc_point']:.4f} "
            f"| {r['auc_robust']:.4f} | {r.get('robust', '')} | {worst:+.4f} | {r['oracle_quality']:.4f} "
            f"| {r['best_single_model_quality']:.4f} "
            f"({r['best_single_model']}) | {r['fit_s']:.1f} | {r['predict_1024_ms']:.1f} ({r['n_models']}) |"
        )
    lines.append("")
    fr = report["budget_fractions"]
    lines.append(
        "| dataset | estimator | "
        + " | ".join(f"{f:g}: point / robust (gain) / uncal." for f in fr)
        + " |"
    )
    lines.append("|" + "---|" * (2 + len(fr)))
    for r in report["results"]:
        cells = []
        for b in r["budgets"]:
            flag = "" if b["point"]["feasible"] else " *"
            unc = b.get("robust_uncalibrated", {})
            cells.append(
                f"{b['point']['quality']:.4f} / {b['robust']['quality']:.4f} "
                f"({100 * b['robust_gain']:+.1f}%) / {unc.get('quality', float('nan')):.4f}{flag}"
            )
        lines.append(f"| {r['dataset']} | {r['estimator']} | " + " | ".join(cells) + " |")
    if report.get("level_sweep"):
        lines.append("")
        lines.append(
            "| dataset | estimator | level | kappa | coverage | AUC point | AUC robust | "
            + " | ".join(f"{f:g}: point / robust" for f in fr)
            + " |"
        )
        lines.append("|" + "---|" * (7 + len(fr)))
        for s in report["level_sweep"]:
            cells = [f"{b['point']:.4f} / {b['robust']:.4f}" for b in s["budgets"]]
            lines.append(
                f"| {s['dataset']} | {s['estimator']} | {s['level']:.2f} | {s['kappa']:.2f} | {s['coverage']:.3f} "
                f"| {s['auc_point']:.4f} | {s['auc_robust']:.4f} | " + " | ".join(cells) + " |"
            )
    if report.get("speed_20_models"):
        lines.append("")
        lines.append("| estimator | predict 1,024 x 20 ms (features given) | featurise texts/s |")
        lines.append("|---|---|---|")
        for s in report["speed_20_models"]:
            lines.append(
                f"| {s['estimator']} | {s['predict_1024_ms']:.1f} | {s['featurise_texts_per_s']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="vendored dc9 only (40%% of it), < 60 s")
    ap.add_argument("--estimators", default="knn,gbdt,irt")
    ap.add_argument(
        "--featurizers", default="hashed", help="comma list: hashed, static, hybrid (issue 13)"
    )
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the level sweep")
    ap.add_argument(
        "--estimator-kwargs",
        type=json.loads,
        default={},
        help='JSON: per estimator, its settings, e.g. \'{"knn": {"prototypes": 512, "prototype_k": 8}}\'',
    )
    ap.add_argument(
        "--featurizer-kwargs",
        type=json.loads,
        default={},
        help='JSON: per featurizer, its settings, e.g. \'{"hashed": {"rank": 32}}\'',
    )
    ap.add_argument("--replicates", type=int, default=20)
    ap.add_argument("--level", type=float, default=0.9)
    ap.add_argument("--out", type=Path, help="also write the JSON report here")
    ap.add_argument(
        "--markdown", type=Path, help="print the tables of a saved JSON report and exit"
    )
    ap.add_argument("--blas-threads", type=int, default=1, help="OpenBLAS threads (0: leave as is)")
    args = ap.parse_args()
    if args.blas_threads:
        limit_blas_threads(args.blas_threads)  # spinning BLAS threads slow a shared machine ~3x
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())))
        return
    args.sweep_levels = (0.5, 0.6, 0.7, 0.8, 0.9)
    args.sweep_estimator = {"dc9": "knn", "ccf20": "irt", "nq6": "knn"}
    report = run(args)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
