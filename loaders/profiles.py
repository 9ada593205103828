"""Read the step-time profiles file (``data/profiles/profiles.json``) into
``routing.profiles.Profiles``.

The file is small and read once per path (cached); :func:`clear_cache` forgets it after a
rebuild (``switchyard profiles build``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from routing.profiles import Profiles
from routing.steptime import StepTimeModel
from schemas import ClusterConfig
from wiring.paths import vendored_data

PROFILES_DIR = vendored_data("profiles")
PROFILES_FILE = PROFILES_DIR / "profiles.json"


@lru_cache(maxsize=4)
def _read(path: str) -> Profiles:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"step-time profiles file {p} is missing; it ships with the repository "
            "(rebuild it with `switchyard profiles build`)"
        )
    return Profiles.from_json(p.read_text(encoding="utf-8"), source=str(p))


def read_profiles(path: Path | None = None) -> Profiles:
    """The profiles of ``path`` (default: the shipped ``profiles.json``)."""
    return _read(str(path or PROFILES_FILE))


def clear_cache() -> None:
    """Forget every file read (after a profiles file was rewritten)."""
    _read.cache_clear()


def profiles_for(cluster: ClusterConfig, path: Path | None = None) -> Profiles | None:
    """The profiles a cluster needs: read only when one of its models names a profile and
    gives no explicit ``step_time`` (None otherwise, so a cluster of explicit coefficients
    needs no profiles file)."""
    if any(m.profile is not None and m.step_time is None for m in cluster.models):
        return read_profiles(path)
    return None


def all_profiles(path: Path | None = None) -> dict[str, Any]:
    """Every profile record, by name (the parsed ``profiles.json``)."""
    return read_profiles(path).all()


def list_profiles(path: Path | None = None) -> list[str]:
    """Profile names, lowercase ``<model>@<gpu>``, sorted."""
    return read_profiles(path).names()


def profile_record(name: str, path: Path | None = None) -> dict[str, Any]:
    """The raw record of one profile (coefficients, table, fit errors, provenance)."""
    return read_profiles(path).record(name)


def load_profile(name: str, path: Path | None = None) -> StepTimeModel:
    """The fitted Eq. 9 model of profile ``name`` (e.g. ``codellama-34b-instruct-hf@h100``)."""
    return read_profiles(path).model(name)
