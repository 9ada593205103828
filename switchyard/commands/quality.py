"""``switchyard train`` and ``switchyard eval-quality``: quality predictor artefacts.

Thin shell over ``offline.datasets`` and ``routing.quality`` (all logic is there).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from offline.blas import limit_blas_threads

FORMAT_HELP = (
    "irt-wide (ccf20 scores.csv.gz), long (dc9 scores_long.csv.gz) or nq-records (nq6 JSON Lines)"
)


def _fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"--budget-fractions must be comma-separated numbers, got {text!r}"
        ) from None
    if not out or any(not 0 < f for f in out):
        raise typer.BadParameter(f"--budget-fractions must be numbers > 0, got {text!r}")
    return out


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(2)


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train(
        data: Path = typer.Option(..., "--data", help="Routing data file"),
        format: str = typer.Option("long", "--format", help=FORMAT_HELP),
        models_csv: Path | None = typer.Option(
            None, "--models-csv", help="Per-model prices (default: models.csv beside --data)"
        ),
        estimator: str = typer.Option(
            "irt", "--estimator", help="irt (default: fastest to predict), knn or gbdt"
        ),
        out: Path = typer.Option(..., "--out", help="Artefact file to write (.npz)"),
        featurizer: str = typer.Option(
            "hashed",
            "--featurizer",
            help="hashed, static (MiniLM distilled), hybrid (both), minilm (full transformer, slow) or auto",
        ),
        replicates: int = typer.Option(20, "--replicates", min=2, help="Bootstrap replicates B"),
        level: float = typer.Option(
            0.9, "--level", help="Nominal coverage of the robust lower bound"
        ),
        test_fraction: float = typer.Option(
            0.2,
            "--test-fraction",
            help="Queries held out from training (for eval-quality); 0 = train on all",
        ),
        seed: int = typer.Option(0, "--seed"),
        prototypes: int = typer.Option(
            1024,
            "--prototypes",
            min=0,
            help="knn: cluster the training queries into this many prototypes and score those "
            "(0: every training query, exact neighbours)",
        ),
        prototype_k: int = typer.Option(
            0,
            "--prototype-k",
            min=0,
            help="knn: prototypes per query (0: as many as hold k=48 training queries on average)",
        ),
        ngram_widths: str = typer.Option(
            "3,4",
            "--ngram-widths",
            help="hashed: the character n-grams hashed besides words, comma-separated widths "
            "(the default predictor uses 3)",
        ),
        feature_rank: int = typer.Option(
            64, "--feature-rank", min=1, help="hashed: dimensions of the projection"
        ),
        projection_dtype: str = typer.Option(
            "float64",
            "--projection-dtype",
            help="hashed: float64 or float32 (the default predictor's: half the bytes read)",
        ),
        blas_threads: int = typer.Option(
            1, "--blas-threads", min=0, help="OpenBLAS threads while training (0: leave as is)"
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON"),
    ) -> None:
        """Train a quality predictor (bootstrap ensemble + conformal lower bound + length model)."""
        from loaders.minilm import minilm_source
        from loaders.predictor import save_predictor
        from offline.datasets import load_routing_data
        from routing.datasets import DataError, split_by_query
        from routing.features import HashedNgramFeaturizer
        from routing.quality import ESTIMATORS, train_predictor

        if estimator not in ESTIMATORS:
            raise _fail(f"--estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        if not 0.0 < level < 1.0:
            raise _fail(f"--level must be in (0, 1), got {level}")
        if not 0.0 <= test_fraction < 1.0:
            raise _fail(f"--test-fraction must be in [0, 1), got {test_fraction}")
        feat: str | HashedNgramFeaturizer = featurizer
        if featurizer == "hashed":
            try:
                widths = [int(w) for w in ngram_widths.split(",") if w.strip()]
            except ValueError:
                raise _fail(
                    f"--ngram-widths must be comma-separated integers, got {ngram_widths!r}"
                ) from None
            try:
                feat = HashedNgramFeaturizer(
                    rank=feature_rank, ngram_widths=widths, projection_dtype=projection_dtype
                )
            except ValueError as e:
                raise _fail(str(e)) from None
        if blas_threads:
            limit_blas_threads(blas_threads)
        t0 = time.perf_counter()
        try:
            rd = load_routing_data(data, format, models_csv)
        except (DataError, ValueError) as e:
            raise _fail(str(e)) from None
        train_part = split_by_query(rd, test_fraction, seed)[0] if test_fraction > 0 else rd
        try:
            pred = train_predictor(
                train_part,
                estimator,
                feat,
                replicates,
                level,
                seed=seed,
                estimator_kwargs=(
                    {"prototypes": prototypes, "prototype_k": prototype_k}
                    if estimator == "knn"
                    else None
                ),
                minilm=None if featurizer == "hashed" else minilm_source(),
            )
        except (RuntimeError, ValueError) as e:
            raise _fail(str(e)) from None
        pred.meta.update({"data": str(data), "format": format, "test_fraction": test_fraction})
        save_predictor(pred, out)
        summary = {
            "out": str(out),
            "estimator": estimator,
            "featurizer": pred.featurizer.name,
            "models": pred.models,
            "n_queries_total": rd.n,
            "n_train_queries": pred.meta["n_train_queries"],
            "n_calibration_queries": pred.meta["n_calibration_queries"],
            "n_held_out_queries": rd.n - train_part.n,
            "replicates": replicates,
            "level": level,
            "kappa": pred.kappa,
            "calibration_coverage": pred.meta["calibration_coverage"],
            "seconds": round(time.perf_counter() - t0, 2),
        }
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
        else:
            for k, v in summary.items():
                typer.echo(f"{k:24s} {v}")

    @app.command("eval-quality")
    def eval_quality(
        predictor: Path = typer.Option(
            ..., "--predictor", help="Artefact written by `switchyard train`"
        ),
        data: Path = typer.Option(..., "--data", help="Routing data file"),
        format: str = typer.Option("long", "--format", help=FORMAT_HELP),
        models_csv: Path | None = typer.Option(None, "--models-csv", help="Per-model prices"),
        budget_fractions: str = typer.Option(
            "0.1,0.25,0.5",
            "--budget-fractions",
            help="Budgets as fractions of the best single model's cost",
        ),
        level: float | None = typer.Option(
            None, "--level", help="Override the predictor's nominal level"
        ),
        include_seen: bool = typer.Option(
            False,
            "--include-seen",
            help="Also evaluate queries the predictor was trained on (leaks!)",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    ) -> None:
        """Coverage of the robust bound and point-vs-robust routing at several budgets."""
        from loaders.predictor import load_predictor
        from offline.datasets import load_routing_data
        from routing.datasets import DataError
        from routing.quality import ArtefactError
        from routing.quality.evaluate import evaluate_predictor

        fractions = _fractions(budget_fractions)
        try:
            pred = load_predictor(predictor)
            if level is not None:
                pred = pred.with_level(level)
            rd = load_routing_data(data, format, models_csv)
            report = evaluate_predictor(pred, rd, fractions, exclude_seen=not include_seen)
        except (ArtefactError, DataError, ValueError) as e:
            raise _fail(str(e)) from None
        if as_json:
            typer.echo(json.dumps(report))
            return
        typer.echo(
            f"{report['estimator']} on {report['n_queries']} held-out queries: coverage {report['coverage']:.3f} "
            f"(nominal {report['nominal_coverage']:.2f}), oracle {report['oracle_quality']:.4f}, "
            f"best single ({report['best_single_model']}) {report['best_single_model_quality']:.4f}"
        )
        typer.echo(f"{'budget':>8} {'point q':>9} {'robust q':>9} {'point $':>11} {'robust $':>11}")
        for b in report["budgets"]:
            typer.echo(
                f"{b['fraction']:>8.2f} {b['point']['quality']:>9.4f} {b['robust']['quality']:>9.4f} "
                f"{b['point']['spend_usd']:>11.5f} {b['robust']['spend_usd']:>11.5f}"
            )
