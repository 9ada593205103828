"""Eq. 9 and table fits on measured vLLM steps, the steps file format, the sweep plan (pure)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from loaders.profiles import all_profiles, load_profile
from offline.vllm_profile import (
    STEPS_FORMAT,
    Step,
    StepArrays,
    merge_repeats,
    profile_record,
    read_steps,
    refit_measured,
    step_from_json,
    steps_text,
    sweep_plan,
    table_step_ms,
)
from routing.profiles import Table
from routing.steptime import StepTimeModel, attn_units

TRUE = StepTimeModel(
    c0_ms=9.0, c1_ms_per_token=0.9, c2_ms_per_ctx_token=0.002, c3_ms_per_attn_unit=2e-5
)
HEADER = {
    "model": "toy@cpu",
    "device": "cpu",
    "shape": {"num_hidden_layers": 4, "hidden_size": 512},
    "kv_blocks": 2048,
    "block_size_tokens": 128,
    "provenance": {"vllm_version": "0.32.0", "cpu_model": "Some CPU @ 2.60GHz"},
}


def _true_ms(decodes: list[int], chunks: list[tuple[int, int]]) -> float:
    n = len(decodes) + sum(q for q, _ in chunks)
    a = sum(float(attn_units(q, c)) for q, c in chunks)
    return float(TRUE.step_ms(n, sum(decodes), a))


def _rows(noise: float = 0.0, seed: int = 0) -> list[dict[str, object]]:
    """Steps a sweep produces: prefill chunks, decode batches, mixed batches."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, object]] = []

    def add(decodes: list[int], chunks: list[tuple[int, int, int]]) -> None:
        ms = _true_ms(decodes, [(q, c) for q, c, _ in chunks]) * (1 + noise * rng.standard_normal())
        reqs = [[1, d, min(d, 64)] for d in decodes] + [[q, c, p] for q, c, p in chunks]
        rows.append({"ms": round(ms, 4), "reqs": reqs, "exp": len(rows)})

    for q in (16, 64, 256, 512):
        for c in (0, 512, 1024):
            add([], [(q, c, q + c)])
    for n in (1, 2, 4, 8, 16):
        for ctx in (64, 512, 1500):
            add([ctx] * n, [])
            add([ctx] * n, [(max(1, 512 - n), 0, 600)])
    return rows


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text(steps_text(HEADER, rows))
    return path


def test_step_classifies_decodes_and_chunks() -> None:
    s = step_from_json({"ms": 12.5, "reqs": [[1, 70, 64], [1, 63, 64], [100, 0, 300]]})
    assert s.decodes == (70,)  # one token past its prompt: a decode
    assert s.chunks == ((1, 63), (100, 0))  # the last prompt token and a chunk are prefill
    assert s.kind == "mixed" and s.n_tokens == 102 and s.n_seqs == 3
    assert step_from_json({"ms": 1, "reqs": [[1, 5, 5]]}).kind == "decode"
    assert step_from_json({"ms": 1, "reqs": [[9, 0, 9]]}).kind == "prefill"


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"reqs": [[1, 1, 1]]}, "need keys"),
        ({"ms": 0, "reqs": [[1, 1, 1]]}, "> 0 ms"),
        ({"ms": 3, "reqs": []}, "non-empty"),
        ({"ms": 3, "reqs": [[1, 2]]}, "[new, ctx, prompt_len]"),
        ({"ms": 3, "reqs": [[0, 2, 3]]}, "new >= 1"),
    ],
)
def test_bad_step_lines_name_the_problem(obj: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=None) as exc:
        step_from_json(obj, "f.jsonl:7")
    assert needle in str(exc.value) and "f.jsonl:7" in str(exc.value)


def test_read_steps_checks_the_header_and_skips_warmup(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ms": 3}\n')
    with pytest.raises(ValueError, match="header"):
        read_steps(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_steps(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(steps_text(HEADER, []) + "{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not JSON"):
        read_steps(broken)
    rows = [{"ms": 99.0, "reqs": [[5, 0, 5]], "warmup": True}, *_rows()]
    path = _write(tmp_path / "s.jsonl", rows)
    header, steps = read_steps(path)
    assert header["format"] == STEPS_FORMAT and len(steps) == len(rows) - 1
    gz = tmp_path / "s.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_steps(gz)[1] == steps


def test_fit_recovers_known_coefficients_and_reports_errors_by_kind(tmp_path: Path) -> None:
    _, steps = read_steps(_write(tmp_path / "s.jsonl", _rows()))
    rec = profile_record(steps, HEADER)
    c = rec["coefficients"]
    assert c["c0_ms"] == pytest.approx(TRUE.c0_ms, rel=1e-3)
    assert c["c1_ms_per_token"] == pytest.approx(TRUE.c1_ms_per_token, rel=1e-3)
    assert c["c2_ms_per_ctx_token"] == pytest.approx(TRUE.c2_ms_per_ctx_token, rel=1e-3)
    assert c["c3_ms_per_attn_unit"] == pytest.approx(TRUE.c3_ms_per_attn_unit, rel=1e-3)
    fit = rec["fit"]
    assert fit["mape"] < 1e-3 and fit["stalls_left_out"] == 0
    assert set(fit["eq9"]["by_kind"]) == {"decode", "prefill", "mixed"}
    assert sum(v["steps"] for v in fit["eq9"]["by_kind"].values()) == fit["rows"] == len(steps)
    assert fit["table"]["mape"] < 0.05  # the table's basis holds Eq. 9 up to its knots
    assert rec["provenance"]["cpu_model"] == "Some CPU @ 2.60GHz"
    assert rec["kv_blocks"] == 2048 and rec["block_size_tokens"] == 128


def test_noisy_steps_and_a_stall(tmp_path: Path) -> None:
    rows = _rows(noise=0.03, seed=1)
    rows[5]["ms"] = float(rows[5]["ms"]) * 6  # type: ignore[arg-type]  # a descheduled step
    _, steps = read_steps(_write(tmp_path / "s.jsonl", rows))
    rec = profile_record(steps, HEADER)
    assert rec["fit"]["stalls_left_out"] == 1
    assert rec["fit"]["mape"] < 0.05
    assert rec["fit"]["eq9_all_steps"]["max_ape"] > 0.8  # the stall still shows in "all steps"
    assert rec["coefficients"]["c1_ms_per_token"] == pytest.approx(0.9, rel=0.05)


def test_record_loads_as_a_profile_and_its_table_prices_steps(tmp_path: Path) -> None:
    _, steps = read_steps(_write(tmp_path / "s.jsonl", _rows()))
    rec = profile_record(steps, HEADER)
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"version": 1, "profiles": {"toy@cpu": rec}}))
    model = load_profile("toy@cpu", path)
    assert model.c1_ms_per_token == pytest.approx(0.9, rel=1e-3)
    table = Table.from_record(all_profiles(path)["toy@cpu"])
    arr = StepArrays.of(steps)
    est = table_step_ms(table, arr)
    assert float(np.mean(np.abs(est - arr.step_ms) / arr.step_ms)) == pytest.approx(
        rec["fit"]["table"]["mape"], abs=1e-3
    )


def test_refit_measured_rebuilds_from_the_steps_file(tmp_path: Path) -> None:
    _write(tmp_path / "toy.steps.jsonl", _rows())
    _, steps = read_steps(tmp_path / "toy.steps.jsonl")
    rec = profile_record(steps, HEADER)
    rec["provenance"]["steps_file"] = "toy.steps.jsonl"
    other = {"coefficients": {}, "table": {}}
    again = refit_measured({"toy@cpu": rec, "h100-thing": other}, tmp_path)
    assert list(again) == ["toy@cpu"] and again["toy@cpu"]["coefficients"] == rec["coefficients"]
    (tmp_path / "toy.steps.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="toy.steps.jsonl"):
        refit_measured({"toy@cpu": rec}, tmp_path)


def test_repeated_batches_are_fitted_at_their_median(tmp_path: Path) -> None:
    rows = _rows()
    burst = [dict(r, ms=float(r["ms"]) * 4) for r in rows]  # type: ignore[arg-type]
    _, steps = read_steps(_write(tmp_path / "s.jsonl", rows + burst + rows))
    merged, repeated = merge_repeats(steps)
    assert len(merged) == repeated == len(rows)
    assert [s.step_ms for s in merged] == [float(r["ms"]) for r in rows]  # type: ignore[arg-type]
    rec = profile_record(steps, HEADER)
    assert rec["fit"]["mape"] < 1e-3 and rec["fit"]["measured_steps"] == 3 * len(rows)


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 8"):
        profile_record([Step(5.0, (10,), ())] * 3, HEADER)


@pytest.mark.parametrize("quick", [True, False])
def test_sweep_plan_stays_inside_the_engine_limits(quick: bool) -> None:
    plan = sweep_plan(16, 512, 2048, quick=quick)
    assert plan
    for e in plan:
        assert 0 <= e["decodes"] <= 16
        assert e["ctx"] + e["decode_steps"] + 16 <= 2048  # the driver asks decode_steps + 16
        assert 0 <= e["prefill"] <= 2046
    kinds = {(e["decodes"] > 0, e["prefill"] > 0) for e in plan}
    assert kinds == {(False, True), (True, False), (True, True)}  # prefill, decode, mixed
    assert max(e["prefill"] for e in plan) > 512  # a prompt chunked on its own context


def test_sweep_plan_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        sweep_plan(0, 512, 2048)
    with pytest.raises(ValueError, match="too small"):
        sweep_plan(4, 64, 12)
