"""``switchyard profiles`` and ``switchyard validate-ttft`` (vendored data; no ../shared needed)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from switchyard.cli import app
from wiring.paths import vendored_data

runner = CliRunner()


def test_profiles_lists_every_profile() -> None:
    res = runner.invoke(app, ["profiles"])
    assert res.exit_code == 0, res.output
    for name in ("llama-2-7b-hf@h100", "codellama-34b-instruct-hf@h100", "llama-2-70b-hf@h100"):
        assert name in res.output
    res = runner.invoke(app, ["profiles", "--json"])
    data = json.loads(res.output)
    assert data["llama-2-7b-hf@h100"]["coefficients"]["c0_ms"] > 0


def test_profiles_build_refits_from_vendored_data(tmp_path: Path) -> None:
    out = tmp_path / "profiles.json"
    res = runner.invoke(app, ["profiles", "build", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rebuilt = json.loads(out.read_text())["profiles"]
    shipped = json.loads(vendored_data("profiles", "profiles.json").read_text())["profiles"]
    for name, rec in shipped.items():
        for k, v in rec["coefficients"].items():
            assert abs(rebuilt[name]["coefficients"][k] - v) <= 1e-6 * max(abs(v), 1e-12), (name, k)


def _csv(path: Path, rows: list[tuple[float, int, int, float]]) -> Path:
    lines = ["arrival_rel_s,input_tokens,output_tokens,ttft_s"]
    lines += [f"{a},{i},{o},{t}" for a, i, o, t in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_validate_ttft_prints_one_json_object(tmp_path: Path) -> None:
    f = _csv(
        tmp_path / "req.csv", [(0.0, 1500, 50, 0.035), (0.01, 800, 20, 0.05), (5.0, 300, 5, 0.02)]
    )
    res = runner.invoke(
        app,
        [
            "validate-ttft",
            "--requests",
            str(f),
            "--profile",
            "llama-2-7b-hf@h100",
            "--json",
            "--max-num-batched-tokens",
            "2048",
            "--max-num-seqs",
            "64",
            "--policy",
            "sarathi",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["n"] == 3
    for key in ("mape_engine", "mape_sfs", "mape_throughput_baseline", "sfs_us_p50"):
        assert out[key] >= 0


def test_validate_ttft_on_the_vendored_real_run() -> None:
    f = vendored_data("profiles", "vllm-runs", "llama-2-7b-hf@h100.csv")
    res = runner.invoke(
        app, ["validate-ttft", "--requests", str(f), "--profile", "llama-2-7b-hf@h100", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["n"] == 282
    assert out["mape_engine"] < 0.15 and out["mape_sfs"] < 0.15


def test_validate_ttft_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_rel_s,input_tokens\n0,10\n")
    res = runner.invoke(
        app, ["validate-ttft", "--requests", str(bad), "--profile", "llama-2-7b-hf@h100"]
    )
    assert res.exit_code != 0
    assert "missing column(s) ['output_tokens', 'ttft_s']" in res.output
    res = runner.invoke(app, ["validate-ttft", "--requests", str(bad), "--profile", "nope@h100"])
    assert res.exit_code != 0 and "unknown step-time profile" in res.output
    f = _csv(tmp_path / "ok.csv", [(0.0, 10, 1, 0.01)])
    res = runner.invoke(
        app,
        ["validate-ttft", "--requests", str(f), "--profile", "llama-2-7b-hf@h100", "--policy", "x"],
    )
    assert res.exit_code != 0 and "--policy must be" in res.output
