"""Every benchmark script answers ``--help`` (argparse formats help strings with ``%``:
a bare ``30%`` in one made ``--help`` crash with a TypeError)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert {p.name for p in SCRIPTS} >= {"service.py", "sfs.py", "ilp.py", "quality.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
