"""Run one faults scenario many times in a row with full logs (``make faults-loop``).

    .venv/bin/python tests/faults/loop_scenario.py --runs 100 --out .switchyard/faults-loop

Default: scenario 4, the Kafka broker ``kill -9``'d and restarted mid-stream
(``test_outages.py::test_kafka_broker_restart_mid_stream_loses_nothing``), whose one
unexplained 1-query loss in 47 runs issue 16 asks about. Each run is a fresh pytest process
with its own broker and Redis, the workers logging at INFO; everything a run wrote (pytest
output, router, worker, broker and Redis logs, the figures JSON) is kept under
``OUT/run-NNN/``, less the broker's and Redis's data files of a run that passed.
``OUT/summary.json`` has one row per run (passed, lost, duplicated, times) and the totals;
the exit code is 0 only if every run passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEST = "tests/faults/test_outages.py::test_kafka_broker_restart_mid_stream_loses_nothing"


def _drop_data(run_dir: Path) -> None:
    """A passing run's broker and Redis data files (segments, AOF) are not worth keeping."""
    for data in run_dir.rglob("data"):
        if data.is_dir() and data.parent.name.startswith("kafka-"):
            shutil.rmtree(data, ignore_errors=True)
    for aof in run_dir.rglob("appendonlydir"):
        shutil.rmtree(aof, ignore_errors=True)


def one_run(i: int, out: Path, test: str, timeout_s: float) -> dict[str, object]:
    run_dir = out / f"run-{i:03d}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    figures = run_dir / "figures.json"
    env = dict(
        os.environ,
        SWITCHYARD_FAULTS_FIGURES=str(figures),
        SWITCHYARD_FAULTS_LOG_LEVEL="INFO",
    )
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
        f"--basetemp={run_dir / 'tmp'}", "--timeout", str(int(timeout_s)), test,
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(run_dir / "pytest.log", "wb") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                timeout=timeout_s + 60,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    row: dict[str, object] = {"run": i, "passed": rc == 0, "rc": rc,
                              "seconds": round(time.monotonic() - t0, 1),
                              "loadavg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
    try:
        scenario = next(iter(json.loads(figures.read_text()).values()))
        for key in (
            "lost",
            "duplicated",
            "routed_twice",
            "kill_to_all_results_s",
            "broker_start_s",
        ):
            if key in scenario:
                row[key] = scenario[key]
    except (OSError, ValueError, StopIteration):
        row["figures"] = "missing"
    if rc == 0:
        _drop_data(run_dir)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--out", type=Path, default=REPO / ".switchyard" / "faults-loop")
    ap.add_argument("--test", default=DEFAULT_TEST)
    ap.add_argument("--timeout-s", type=float, default=420.0, help="per run")
    ap.add_argument("--stop-on-failure", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    summary_path = args.out / "summary.json"
    for i in range(1, args.runs + 1):
        row = one_run(i, args.out, args.test, args.timeout_s)
        rows.append(row)
        passed = sum(1 for r in rows if r["passed"])
        lost = sum(int(r.get("lost", 0) or 0) for r in rows)  # type: ignore[call-overload]
        summary = {"test": args.test, "runs": len(rows), "passed": passed, "lost_total": lost,
                   "rows": rows}  # fmt: skip
        summary_path.write_text(json.dumps(summary, indent=1))
        print(f"run {i}: {'passed' if row['passed'] else 'FAILED'} {row}", flush=True)
        if args.stop_on_failure and not row["passed"]:
            break
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
