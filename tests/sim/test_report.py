"""``switchyard simulate`` plots and its HTML report, checked as pictures.

The timeline of a short run has visible points (it drew one 60 s bin before: an empty
plot); the HTML page, rendered by headless Chromium (Debian's, installed when missing),
shows the results table and both plots.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim import report as rep

C0 = np.array([0x1F, 0x77, 0xB4]) / 255  # matplotlib's first and second line colours
C1 = np.array([0xFF, 0x7F, 0x0E]) / 255


def colour_share(png: Path, colour: np.ndarray) -> float:
    import matplotlib.image as mpimg

    img = mpimg.imread(str(png))[..., :3]
    return float((np.abs(img - colour).max(axis=-1) < 0.08).mean())


def test_timeline_bins_follow_the_span() -> None:
    assert rep.timeline_bin_s(30) == 1.0 and rep.timeline_bin_s(600) == 15.0
    assert rep.timeline_bin_s(3600) == 90.0 or rep.timeline_bin_s(3600) == 120.0


def run_simulate(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    from offline.predictor import ensure_default_predictor
    from wiring.paths import state_dir

    predictor = ensure_default_predictor(state_dir() / "predictors")
    args = [sys.executable, "-m", "switchyard.cli", "simulate", "--trace", "poisson:8",
            "--duration-s", "40", "--policy", "round-robin", "--policy", "shortest-queue",
            "--predictor", str(predictor), "--cluster", "configs/clusters/paper_a_dc9.yaml", *extra]  # fmt: skip
    from wiring.paths import REPO_ROOT

    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc


def test_short_run_timeline_shows_both_policies(tmp_path: Path) -> None:
    run_simulate(tmp_path, "--plots", str(tmp_path / "plots"))
    timeline = tmp_path / "plots" / "timeline.png"
    assert colour_share(timeline, C0) > 0.002 and colour_share(timeline, C1) > 0.002


def chromium() -> str:
    from switchyard.services import ServiceError, ensure_debian_tool

    try:
        return ensure_debian_tool("chromium", "chromium")
    except ServiceError as exc:
        pytest.skip(str(exc))


def test_html_report_renders_with_its_plots(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    run_simulate(tmp_path, "--html", str(page))
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 2 and "OnTimeUtility" in text
    assert "round-robin" in text and "shortest-queue" in text
    shot = tmp_path / "report.png"
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1200,1500", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and shot.exists(), proc.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(str(shot))
    assert img.shape[:2] == (1500, 1200)
    # both policies' lines are on the page (the plots rendered), and it is not a blank page
    assert colour_share(shot, C0) > 0.0004 and colour_share(shot, C1) > 0.0004
    assert float((img[..., :3] < 0.5).mean()) > 0.005  # text and axes
