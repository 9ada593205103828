"""``switchyard train`` and ``switchyard eval-quality`` (switchyard/commands/quality.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from switchyard.cli import app
from wiring.paths import shared_data

# OpenBLAS threads busy-wait: one BLAS thread for this module (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_blas_thread")


runner = CliRunner()

WORDS = {
    "math": "compute sum integral derivative fraction equation".split(),
    "history": "king empire dynasty war century treaty".split(),
}
P = {"math": {"cheap": 0.3, "dear": 0.9}, "history": {"cheap": 0.8, "dear": 0.85}}


def _data(tmp_path: Path, n: int = 240) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "scores.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["query_id", "task", "model", "score", "text"])
        for i in range(n):
            task = "math" if i % 2 else "history"
            text = f"{i}: " + " ".join(rng.choice(WORDS[task], 5))
            for model in ("cheap", "dear"):
                w.writerow([f"q{i}", task, model, float(rng.random() < P[task][model]), text])
    (tmp_path / "models.csv").write_text(
        "model,input_price_per_1m_usd,output_price_per_1m_usd\ncheap,0.1,0.1\ndear,1.0,1.0\n"
    )
    return path


def test_train_then_eval_quality_json(tmp_path: Path) -> None:
    data = _data(tmp_path)
    out = tmp_path / "pred.npz"
    res = runner.invoke(
        app,
        [
            "train",
            "--data",
            str(data),
            "--format",
            "long",
            "--estimator",
            "knn",
            "--out",
            str(out),
            "--replicates",
            "5",
            "--level",
            "0.8",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["n_held_out_queries"] == 48 and out.exists()
    res = runner.invoke(
        app,
        [
            "eval-quality",
            "--predictor",
            str(out),
            "--data",
            str(data),
            "--format",
            "long",
            "--models-csv",
            str(tmp_path / "models.csv"),
            "--budget-fractions",
            "0.25,0.5,1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["n_queries"] == 48  # only the held-out queries: no leakage
    assert rep["nominal_coverage"] == 0.8
    assert 0.0 <= rep["coverage"] <= 1.0
    assert rep["oracle_quality"] >= rep["best_single_model_quality"]
    assert [b["fraction"] for b in rep["budgets"]] == [0.25, 0.5, 1.0]
    for b in rep["budgets"]:
        for kind in ("point", "robust"):
            assert set(b[kind]) >= {"quality", "spend_usd", "predicted_spend_usd", "lambda"}
            assert b[kind]["predicted_spend_usd"] <= b["budget_usd"] * (1 + 1e-9)


def test_train_reports_bad_row(tmp_path: Path) -> None:
    data = _data(tmp_path, n=10)
    text = data.read_text().splitlines()
    parts = text[3].split(",")
    parts[3] = "abc"
    text[3] = ",".join(parts)
    data.write_text("\n".join(text) + "\n")
    res = runner.invoke(
        app, ["train", "--data", str(data), "--format", "long", "--out", str(tmp_path / "p.npz")]
    )
    assert res.exit_code == 2
    assert "row 3: score must be in [0, 1], got 'abc'" in res.output


def test_bad_options_are_named(tmp_path: Path) -> None:
    data = _data(tmp_path, n=10)
    res = runner.invoke(
        app, ["train", "--data", str(data), "--estimator", "forest", "--out", str(tmp_path / "p")]
    )
    assert res.exit_code == 2 and "--estimator must be one of knn, gbdt, irt" in res.output
    res = runner.invoke(
        app,
        ["eval-quality", "--predictor", str(tmp_path / "none.npz"), "--data", str(data), "--json"],
    )
    assert res.exit_code == 2 and "no such predictor file" in res.output


@pytest.mark.shared_data
def test_nq_records_with_vendored_prices(tmp_path: Path) -> None:
    records = shared_data("routing", "llmrouter_nq6", "nq_router_records.jsonl")
    if not records.exists():
        pytest.skip(f"{records} is absent")
    from wiring.paths import vendored_data

    prices = vendored_data("routing", "llmrouter_nq6", "models.csv")
    out = tmp_path / "nq.npz"
    res = runner.invoke(
        app,
        [
            "train",
            "--data",
            str(records),
            "--format",
            "nq-records",
            "--models-csv",
            str(prices),
            "--estimator",
            "irt",
            "--replicates",
            "4",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app,
        [
            "eval-quality",
            "--predictor",
            str(out),
            "--data",
            str(records),
            "--format",
            "nq-records",
            "--models-csv",
            str(prices),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["n_queries"] == 100
    assert rep["output_length_mae_tokens"] is not None and rep["output_length_mae_tokens"] > 0


def test_train_knn_prototypes_reach_the_artefact(tmp_path: Path) -> None:
    from loaders.predictor import load_predictor

    data = _data(tmp_path)
    for extra, want in (([], (1024, 0)), (["--prototypes", "16", "--prototype-k", "3"], (16, 3))):
        out = tmp_path / f"pred{len(extra)}.npz"
        base = ["train", "--data", str(data), "--format", "long", "--estimator", "knn"]
        res = runner.invoke(app, [*base, "--out", str(out), "--replicates", "3", *extra])
        assert res.exit_code == 0, res.output
        est = load_predictor(out).estimator
        assert (est.prototypes, est.prototype_k) == want
        # ~150 fit rows: 1,024 prototypes are one row each (exact kNN); 16 are clusters
        if want[0] == 1024:
            np.testing.assert_array_equal(est.C, est.Z)
        else:
            assert len(est.C) == 16 < len(est.Z)


def test_train_featurizer_settings_reach_the_artefact(tmp_path: Path) -> None:
    from loaders.predictor import load_predictor

    data = _data(tmp_path)
    cheap = ["--ngram-widths", "3", "--feature-rank", "8", "--projection-dtype", "float32"]
    for extra, want in (([], ((3, 4), 64, "float64")), (cheap, ((3,), 8, "float32"))):
        out = tmp_path / f"pred{len(extra)}.npz"
        base = ["train", "--data", str(data), "--format", "long", "--estimator", "knn"]
        res = runner.invoke(app, [*base, "--out", str(out), "--replicates", "3", *extra])
        assert res.exit_code == 0, res.output
        f = load_predictor(out).featurizer
        assert (f.ngram_widths, f.rank, f.projection_dtype) == want
    bad = ["train", "--data", str(data), "--out", str(tmp_path / "p.npz")]
    res = runner.invoke(app, [*bad, "--projection-dtype", "float16"])
    assert res.exit_code == 2 and "projection_dtype must be one of" in res.output
    res = runner.invoke(app, [*bad, "--ngram-widths", "3,3"])
    assert res.exit_code == 2 and "ngram_widths must be distinct" in res.output
    res = runner.invoke(app, [*bad, "--ngram-widths", "3,four"])
    assert res.exit_code == 2 and "--ngram-widths must be comma-separated integers" in res.output
