"""Subprocesses started and stopped by pid (never by name): the demo, ``bench/`` and the
integration tests run routers, workers and fake vLLM servers through ``ProcessGroup``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from wiring.paths import REPO_ROOT


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    """Subprocesses started here, stopped here, by pid only (never by name)."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        env = dict(self.env)
        env.setdefault("PYTHONPATH", str(REPO_ROOT))
        env["PYTHONUNBUFFERED"] = "1"
        if extra_env:
            env.update(extra_env)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
                start_new_session=True,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def switchyard(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> Child:
        return self.start(name, [sys.executable, "-m", "switchyard.cli", *args], extra_env)

    def wait_for_line(self, child: Child, text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in child.tail(1_000_000):
                return
            if not child.alive():
                raise RuntimeError(
                    f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}"
                )
            time.sleep(0.1)
        raise TimeoutError(
            f"{child.name} did not print {text!r} within {timeout_s:.0f} s:\n{child.tail()}"
        )

    def stop(self, child: Child, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; only this child's pid."""
        if child.alive():
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait(10)
        return child.proc.returncode

    def kill(self, child: Child) -> None:
        """SIGKILL (crash tests)."""
        if child.alive():
            child.proc.kill()
            child.proc.wait(10)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            self.stop(child)
        self.children.clear()
