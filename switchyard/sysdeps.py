"""System tools the project installs itself (Debian packages, as root) when they are missing."""

from __future__ import annotations

import os
import shutil
import subprocess


class MissingTool(RuntimeError):
    """A tool is not installed and cannot be installed here; the message says how to."""


def ensure_apt_binary(binary: str, package: str | None = None) -> str:
    """The path of ``binary``; ``apt-get install PACKAGE`` first when missing (root only)."""
    path = shutil.which(binary)
    if path:
        return path
    package = package or binary
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise MissingTool(f"{binary} is not installed: run `apt-get install {package}` as root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise MissingTool(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    path = shutil.which(binary)
    if not path:
        raise MissingTool(f"apt-get installed {package} but {binary} is not on PATH")
    return path
