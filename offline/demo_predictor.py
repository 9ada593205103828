"""The demo's and the service benchmark's quality predictor: kNN on the vendored
``data/routing/llmrouter_dc9`` scores, trained once (~15 s) and kept under the state folder."""

from __future__ import annotations

from pathlib import Path

from offline.blas import limit_blas_threads
from wiring.paths import state_dir, vendored_data

DEMO_DATA = vendored_data("routing", "llmrouter_dc9", "scores_long.csv.gz")


def ensure_predictor() -> Path:
    """The artefact's path; trains it first when it is not there yet (same as
    ``switchyard train --data DEMO_DATA --format long --estimator knn --replicates 8
    --test-fraction 0``)."""
    from routing.datasets import load_routing_data
    from routing.quality import train_predictor

    predictor = state_dir() / "demo" / "predictor-dc9-knn.npz"
    if predictor.exists():
        return predictor
    predictor.parent.mkdir(parents=True, exist_ok=True)
    limit_blas_threads(1)  # spinning BLAS threads slow training several-fold on a shared machine
    data = load_routing_data(DEMO_DATA, "long", None)
    pred = train_predictor(data, "knn", "hashed", 8, 0.9, seed=0)
    pred.meta.update({"data": str(DEMO_DATA), "format": "long", "test_fraction": 0.0})
    partial = predictor.with_name(predictor.name + ".partial.npz")
    pred.save(partial)
    partial.replace(predictor)  # a reader never sees half an artefact
    return predictor
