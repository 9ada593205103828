"""The demo's and the service benchmark's quality predictor: the default one
(``offline.predictor``: kNN on the vendored ``data/routing/llmrouter_dc9`` scores), trained
once and kept under the state folder."""

from __future__ import annotations

from pathlib import Path

from offline.predictor import DEFAULT_RECIPE, ensure_default_predictor
from wiring.paths import state_dir

DEMO_DATA = DEFAULT_RECIPE.data_path


def ensure_predictor() -> Path:
    """The artefact's path; trains it first when it is not there yet."""
    return ensure_default_predictor(state_dir() / "predictors")
