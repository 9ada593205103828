"""``switchyard profile-vllm --quick`` on the REAL vLLM engine (CPU build, random weights).

A short sweep (about 15 s of steps after ~5-15 s of engine start): the steps file carries the
provenance (vLLM version, CPU model string, threads, date, command) and every step what the
scheduler put in it; the fitted profile loads like the shipped ones and its Eq. 9 fit is
reported per step kind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loaders.profiles import all_profiles, load_profile
from offline.vllm_profile import STEPS_FORMAT, read_steps
from routing.profiles import Table
from switchyard.cli import app

pytestmark = [pytest.mark.vllm]


def test_quick_profile_of_the_real_engine(tmp_path: Path) -> None:
    out = tmp_path / "prof.json"
    steps = tmp_path / "steps.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "profile-vllm", "--quick", "--name", "tiny-test@cpu", "--out", str(out),
            "--steps-out", str(steps), "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--max-model-len", "1024", "--timeout-s", "240",
        ],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    header, measured = read_steps(steps)
    assert header["format"] == STEPS_FORMAT
    prov = header["provenance"]
    assert re.match(r"0\.32", prov["vllm_version"])
    assert prov["cpu_model"] and "/" not in prov["cpu_model"]
    assert prov["engine"]["max_num_batched_tokens"] == 256 and prov["date_utc"].endswith("Z")
    assert "profile-vllm" in prov["command"] and str(tmp_path) not in prov["command"]
    kinds = {s.kind for s in measured}
    assert kinds == {"decode", "prefill", "mixed"}, kinds
    assert all(s.n_tokens <= 256 and s.n_seqs <= 8 for s in measured)  # the engine's limits
    assert all(s.step_ms > 0 for s in measured)
    rec = all_profiles(out)["tiny-test@cpu"]
    fit = rec["fit"]
    assert fit["measured_steps"] == len(measured)
    assert fit["rows"] + fit["stalls_left_out"] == fit["compositions"] <= len(measured)
    assert set(fit["eq9"]["by_kind"]) == {"decode", "prefill", "mixed"}
    model = load_profile("tiny-test@cpu", out)
    assert model.c1_ms_per_token > 0  # more tokens, longer steps
    # a fit, not a constant: a 256-token prefill costs clearly more than a lone decode
    assert float(model.prefill_ms(256)) > 3 * float(model.step_ms(1, 64))
    assert fit["mape"] < 0.5, fit  # loose: a shared 2-core machine; the shipped one is the gauge
    Table.from_record(rec)  # the simulated engine's table loads
    assert json.loads(out.read_text())["version"] == 1
