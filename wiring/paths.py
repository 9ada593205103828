"""Where things are: the repository root, its vendored data, and ../shared beside it."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


# the cluster every command uses when given none (``--cluster`` or ``$SWITCHYARD_CLUSTER``)
DEFAULT_CLUSTER = REPO_ROOT / "configs" / "demo-cluster.yaml"


def shared_dir() -> Path:
    """``$SWITCHYARD_SHARED``, else ``../shared`` beside the repository root."""
    env = os.environ.get("SWITCHYARD_SHARED")
    return Path(env) if env else REPO_ROOT.parent / "shared"


def shared_data(*parts: str) -> Path:
    return shared_dir().joinpath("data", *parts)


def vendored_data(*parts: str) -> Path:
    return REPO_ROOT.joinpath("data", *parts)


def state_dir() -> Path:
    """Run-time files of local services (pids, logs, data): ``$SWITCHYARD_HOME`` or ``.switchyard/``."""
    env = os.environ.get("SWITCHYARD_HOME")
    return Path(env) if env else REPO_ROOT / ".switchyard"
