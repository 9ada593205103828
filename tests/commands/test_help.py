"""The command line names what users can choose, and its defaults work from any folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from routing.policies import ROUTERS
from switchyard.commands.router import POLICY_NAMES
from wiring.paths import DEFAULT_CLUSTER


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")
    env.pop("SWITCHYARD_CLUSTER", None)
    return subprocess.run([sys.executable, "-m", "switchyard.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120)  # fmt: skip


def test_policy_names_in_help_are_the_registry(tmp_path: Path) -> None:
    assert tuple(sorted(ROUTERS)) == POLICY_NAMES
    for command in ("router", "simulate"):
        out = cli(command, "--help", cwd=tmp_path).stdout
        for name in POLICY_NAMES:
            assert name in out, f"{command} --help does not name {name}"


def test_cluster_default_is_absolute_and_read_from_the_environment(tmp_path: Path) -> None:
    assert DEFAULT_CLUSTER.is_absolute() and DEFAULT_CLUSTER.exists()
    out = cli("batch", "--help", cwd=tmp_path).stdout
    assert "SWITCHYARD_CLUSTER" in out
    # from a folder outside the repository, a bad --input is the only complaint
    bad = cli("batch", "--input", "missing.jsonl", "--out", "o.jsonl", "--budget-usd", "1", cwd=tmp_path)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr and "cluster" not in bad.stderr.lower()


def test_policy_options_from_the_command_line(tmp_path: Path) -> None:
    """``--policy-opt key=value`` reaches the policy; a mistake is a clear error (exit 2)."""
    bad = cli("router", "--policy", "latency-aware", "--policy-opt", "deltaa=1", cwd=tmp_path)
    assert bad.returncode == 2 and "no option deltaa" in bad.stderr, bad.stderr
    worse = cli("router", "--policy-opt", "delta", cwd=tmp_path)
    assert worse.returncode == 2 and "'delta' is not key=value" in worse.stderr, worse.stderr


def test_load_shedding_is_settable_from_router_and_simulate(tmp_path: Path) -> None:
    """``--shed-backlog`` / ``--shed-after-slo`` on both commands, into the one window
    settings both worlds read (``routing.window.WindowSettings``)."""
    from routing.window import WindowSettings
    from sim.evaluator import EvalConfig
    from streams.service import RouterConfig

    for command in ("router", "simulate"):
        out = cli(command, "--help", cwd=tmp_path).stdout
        assert "--shed-backlog" in out and "--shed-after-slo" in out, command
        bad = cli(command, "--shed-backlog", "-1", cwd=tmp_path)
        assert bad.returncode == 2 and "shed-backlog" in bad.stderr, bad.stderr
    want = WindowSettings(shed_backlog=500, shed_after_slo=0.5)
    assert RouterConfig(shed_backlog=500, shed_after_slo=0.5).window == want
    assert EvalConfig(shed_backlog=500, shed_after_slo=0.5).window == want
    assert RouterConfig().window == EvalConfig().window == WindowSettings()


def test_a_dedupe_ttl_shorter_than_a_hold_is_refused(tmp_path: Path) -> None:
    """A dedupe entry that expires while its query may still be redelivered would let a
    crash route it twice: refused, named, before anything starts."""
    bad = cli("router", "--dedupe-ttl-s", "30", "--max-hold-s", "60", cwd=tmp_path)
    assert bad.returncode == 2
    assert "--dedupe-ttl-s 30" in bad.stderr and "use at least 70" in bad.stderr
