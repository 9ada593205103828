"""Quality predictors: per-(query, model) quality with a robust lower bound (paper B).

Estimators (``knn``, ``gbdt``, ``irt``) are each fitted as a bootstrap ensemble
(``base.py``); the lower bound is calibrated by split conformal (``calibration.py``); how much of it to route on is
selected on calibration queries (``robustness.py``, stored in the artefact);
``QualityPredictor`` bundles features, ensemble, calibration, output-length predictor
and prices into one versioned artefact (``to_bytes`` / ``predictor_from_bytes``; the file
is written and read by ``loaders.predictor``).
"""

from routing.quality.base import QualityEstimate, bootstrap_weights
from routing.quality.calibration import conformal_kappa, coverage
from routing.quality.predictor import (
    ARTEFACT_VERSION,
    ESTIMATORS,
    ArtefactError,
    QualityPredictor,
    make_estimator,
    predictor_from_bytes,
    recalibrate,
    train_predictor,
)
from routing.quality.robustness import RobustSpec, Selection, select_robustness

__all__ = [
    "ARTEFACT_VERSION",
    "ESTIMATORS",
    "ArtefactError",
    "QualityEstimate",
    "QualityPredictor",
    "bootstrap_weights",
    "conformal_kappa",
    "coverage",
    "make_estimator",
    "predictor_from_bytes",
    "recalibrate",
    "RobustSpec",
    "Selection",
    "select_robustness",
    "train_predictor",
]
