"""Loaders (offline/datasets.py), the wide view and splits (routing/datasets.py)."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from offline.datasets import load_routing_data, read_models_csv
from routing.datasets import DataError, split_by_query
from wiring.paths import shared_data, vendored_data

MODELS_CSV = "model,input_price_per_1m_usd,output_price_per_1m_usd\nsmall,0.1,0.2\nbig,1.0,2.0\n"


def _write_long(path: Path, rows: list[dict[str, object]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _long_rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for q in range(6):
        for model, s in (("small", 0.0), ("big", 1.0)):
            rows.append(
                {
                    "query_hash": f"h{q}",
                    "task": "a" if q < 3 else "b",
                    "model": model,
                    "score": s,
                    "query": f"question number {q}\nwith a newline",
                }
            )
    return rows


def test_long_loader_builds_wide_view(tmp_path: Path) -> None:
    _write_long(tmp_path / "d.csv", _long_rows())
    (tmp_path / "models.csv").write_text(MODELS_CSV)
    d = load_routing_data(tmp_path / "d.csv", "long")  # models.csv beside the data is found
    assert d.n == 6 and d.models == ["small", "big"]
    assert d.scores.shape == (6, 2)
    np.testing.assert_array_equal(d.scores[:, 0], 0.0)
    np.testing.assert_array_equal(d.scores[:, 1], 1.0)
    np.testing.assert_allclose(d.input_usd_per_token, [1e-7, 1e-6])
    assert d.texts[0] == "question number 0\nwith a newline"
    assert (d.prompt_tokens > 0).all()
    assert np.isnan(d.output_tokens).all() and d.cost_is_estimated
    cost = d.realised_cost_usd(100.0)
    np.testing.assert_allclose(cost[:, 1], d.prompt_tokens * 1e-6 + 100 * 2e-6)


def test_repeated_query_rows_are_averaged(tmp_path: Path) -> None:
    rows = _long_rows()
    rows.append(
        {
            "query_hash": "h0",
            "task": "a",
            "model": "big",
            "score": 0.0,
            "query": "question number 0\nwith a newline",
        }
    )
    _write_long(tmp_path / "d.csv", rows)
    d = load_routing_data(tmp_path / "d.csv", "long")
    assert d.n == 6
    assert d.scores[0, 1] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("score", "abc", "row 3: score must be in [0, 1], got 'abc'"),
        ("score", "1.5", "row 3: score must be in [0, 1], got '1.5'"),
        ("query", "", "row 3: query must be a non-empty string"),
    ],
)
def test_malformed_long_row_names_row_and_field(
    tmp_path: Path, field: str, value: str, message: str
) -> None:
    rows = _long_rows()
    rows[2][field] = value
    _write_long(tmp_path / "d.csv", rows)
    with pytest.raises(DataError) as err:
        load_routing_data(tmp_path / "d.csv", "long")
    assert message in str(err.value)


def test_unknown_model_names_row_and_model(tmp_path: Path) -> None:
    rows = _long_rows()
    rows[4]["model"] = "mystery"
    _write_long(tmp_path / "d.csv", rows)
    (tmp_path / "prices.csv").write_text(MODELS_CSV)
    with pytest.raises(DataError, match=r"row 5: model 'mystery' is not in the models table"):
        load_routing_data(tmp_path / "d.csv", "long", tmp_path / "prices.csv")


def test_missing_column_is_named(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("query_hash,model,score\nh,a,1\n")
    with pytest.raises(DataError, match="no query text column"):
        load_routing_data(tmp_path / "d.csv", "long")


def test_models_csv_per_token_and_per_million(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("model,input_usd_per_token,output_usd_per_token\nx,1e-7,2e-7\n")
    p = read_models_csv(tmp_path / "a.csv")
    np.testing.assert_allclose(p.output_usd_per_token, [2e-7])
    (tmp_path / "b.csv").write_text(
        "model,input_price_per_1m_usd,output_price_per_1m_usd\nx,0.1,-1\n"
    )
    with pytest.raises(DataError, match=r"row 1: output_price_per_1m_usd must be in \[0, inf\]"):
        read_models_csv(tmp_path / "b.csv")


def test_irt_wide_loader(tmp_path: Path) -> None:
    path = tmp_path / "s.csv.gz"
    with gzip.open(path, "wt", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["task", "id", "question", "m1", "m2"])
        w.writerow(["math", 0, "1+1?", 1.0, 0.0])
        w.writerow(["math", 1, "2+2?", 0.5, ""])  # m2 not evaluated
        w.writerow(["qa", 0, "capital of France?", 0.0, 1.0])
    (tmp_path / "models.csv").write_text(
        "model,input_usd_per_token,output_usd_per_token\nm1,1e-7,1e-7\nm2,2e-7,2e-7\n"
    )
    d = load_routing_data(path, "irt-wide")
    assert d.query_ids == ["math:0", "math:1", "qa:0"]  # (task, id) is the key
    assert d.tasks == ["math", "math", "qa"]
    assert np.isnan(d.scores[1, 1]) and d.scores[1, 0] == 0.5


def test_irt_wide_bad_score_names_column(tmp_path: Path) -> None:
    (tmp_path / "s.csv").write_text("task,id,question,m1\nmath,0,q,1\nmath,1,q2,yes\n")
    with pytest.raises(DataError, match=r"row 2: m1 must be in \[0, 1\], got 'yes'"):
        load_routing_data(tmp_path / "s.csv", "irt-wide")


def test_nq_records_align_by_name_and_recover_tokens(tmp_path: Path) -> None:
    recs = [
        {
            "q_id": 0,
            "query": "who?",
            "source": "nq",
            "llm_name_list": ["small", "big"],
            "perf_list": [0.0, 1.0],
            "cost_list": [2.0, 40.0],
        },
        {
            "q_id": 1,
            "query": "what?",
            "source": "nq",
            "llm_name_list": ["big", "small"],
            "perf_list": [0.5, 1.0],
            "cost_list": [20.0, 3.0],
        },
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (tmp_path / "models.csv").write_text(MODELS_CSV)
    d = load_routing_data(path, "nq-records")
    assert d.models == ["small", "big"]
    np.testing.assert_allclose(d.scores, [[0.0, 1.0], [1.0, 0.5]])
    np.testing.assert_allclose(d.cost_usd, [[2e-6, 40e-6], [3e-6, 20e-6]])
    np.testing.assert_allclose(d.output_tokens, [[10, 20], [15, 10]])  # micro-USD / USD-per-1M
    assert not d.cost_is_estimated


def test_nq_records_bad_perf(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(
        json.dumps({"q_id": 0, "query": "q", "llm_name_list": ["a"], "perf_list": ["x"]}) + "\n"
    )
    with pytest.raises(DataError, match=r"row 1: perf_list\[0\] must be in \[0, 1\], got 'x'"):
        load_routing_data(path, "nq-records")


def test_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown format 'wide'"):
        load_routing_data(tmp_path / "x.csv", "wide")


def test_split_by_query_has_no_leakage_and_is_deterministic(tmp_path: Path) -> None:
    rows = []
    for q in range(200):
        for model in ("small", "big"):
            rows.append(
                {
                    "query_hash": f"h{q}",
                    "task": f"t{q % 3}",
                    "model": model,
                    "score": 1.0,
                    "query": f"text {q}",
                }
            )
    _write_long(tmp_path / "d.csv", rows)
    d = load_routing_data(tmp_path / "d.csv", "long")
    tr, te = split_by_query(d, 0.25, seed=7)
    assert set(tr.query_ids).isdisjoint(te.query_ids)
    assert set(tr.texts).isdisjoint(te.texts)
    assert sorted(tr.query_ids + te.query_ids) == sorted(d.query_ids)
    assert te.n == pytest.approx(50, abs=2)
    for t in ("t0", "t1", "t2"):  # stratified by task
        assert te.tasks.count(t) == pytest.approx(d.tasks.count(t) * 0.25, abs=1)
    tr2, te2 = split_by_query(d, 0.25, seed=7)
    assert te2.query_ids == te.query_ids


def test_vendored_dc9_has_no_gpqa_and_loads() -> None:
    d = load_routing_data(vendored_data("routing", "llmrouter_dc9", "scores_long.csv.gz"), "long")
    assert d.m == 9 and d.n == 5541
    assert not any("gpqa" in t for t in d.tasks)
    assert not np.isnan(d.scores).any()
    assert np.isfinite(d.input_usd_per_token).all()


@pytest.mark.shared_data
def test_shared_sources_load() -> None:
    root = shared_data("routing")
    if not root.exists():
        pytest.skip(f"{root} is absent")
    ccf = load_routing_data(root / "irt_router_ccf20" / "scores.csv.gz", "irt-wide")
    assert (ccf.n, ccf.m) == (12864, 20)
    assert "deepseek_chat" in ccf.models
    nq = load_routing_data(
        root / "llmrouter_nq6" / "nq_router_records.jsonl",
        "nq-records",
        vendored_data("routing", "llmrouter_nq6", "models.csv"),
    )
    assert (nq.n, nq.m) == (500, 6)
    tokens = nq.output_tokens
    np.testing.assert_allclose(tokens, np.round(tokens), atol=1e-6)  # cost / price is a token count
