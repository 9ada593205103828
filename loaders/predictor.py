"""Read and write quality-predictor artefact files (``routing.quality`` parses and builds
the bytes: ``predictor_from_bytes`` / ``QualityPredictor.to_bytes``)."""

from __future__ import annotations

import os
from pathlib import Path

from loaders.minilm import minilm_source
from routing.minilm import MiniLMSource
from routing.quality import ArtefactError, QualityPredictor, predictor_from_bytes


def load_predictor(path: str | Path, minilm: MiniLMSource | None = None) -> QualityPredictor:
    """Load an artefact written by :func:`save_predictor`; checks format and version.
    A MiniLM featurizer runs on ``minilm`` (default: the installed MiniLM, if any)."""
    path = Path(path)
    if not path.exists():
        raise ArtefactError(f"{path}: no such predictor file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtefactError(f"{path}: not a predictor artefact ({e})") from None
    return predictor_from_bytes(data, str(path), minilm or minilm_source())


def save_predictor(predictor: QualityPredictor, path: str | Path) -> None:
    """Write one ``.npz`` file (no pickle), atomically (a temporary file, then a rename)."""
    path = Path(path)
    data = predictor.to_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
