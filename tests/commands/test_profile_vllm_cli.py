"""``switchyard profile-vllm --from-steps``: re-fit a steps file, write and merge the profile
(no engine started; tests/vllm/test_profile_vllm.py runs the real one)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from loaders.profiles import load_profile
from offline.vllm_profile import steps_text
from switchyard.cli import app

runner = CliRunner(env={"COLUMNS": "300"})
HEADER = {"model": "toy@cpu", "device": "cpu", "shape": {}, "provenance": {"cpu_model": "X"}}


def _steps(path: Path) -> Path:
    rows = []
    for q in (16, 64, 256, 512):
        rows.append({"ms": 10 + 1.0 * q, "reqs": [[q, 0, q]]})
    for n in (1, 4, 16):
        for ctx in (64, 1024):
            rows.append({"ms": 10 + n + 0.002 * n * ctx, "reqs": [[1, ctx, ctx]] * n})
    path.write_text(steps_text(HEADER, rows))
    return path


def test_from_steps_writes_and_merges_a_loadable_profile(tmp_path: Path) -> None:
    steps = _steps(tmp_path / "toy.steps.jsonl")
    target = tmp_path / "profiles.json"
    target.write_text(json.dumps({"version": 1, "profiles": {}}))
    out = tmp_path / "toy.json"
    res = runner.invoke(
        app,
        [
            "profile-vllm",
            "--from-steps",
            str(steps),
            "--out",
            str(out),
            "--merge-into",
            str(target),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "toy@cpu" in res.output and "decode" in res.output and "prefill" in res.output
    for path in (out, target):
        m = load_profile("toy@cpu", path)
        assert abs(m.c1_ms_per_token - 1.0) < 1e-3 and abs(m.c0_ms - 10.0) < 1e-2
    rec = json.loads(out.read_text())["profiles"]["toy@cpu"]
    assert rec["provenance"]["steps_file"] == "toy.steps.jsonl"


def test_bad_steps_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    res = runner.invoke(app, ["profile-vllm", "--from-steps", str(tmp_path / "none.jsonl")])
    assert res.exit_code != 0 and "not found" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "something-else"}\n')
    res = runner.invoke(
        app, ["profile-vllm", "--from-steps", str(bad), "--out", str(tmp_path / "o.json")]
    )
    assert res.exit_code == 1 and "header" in res.output
