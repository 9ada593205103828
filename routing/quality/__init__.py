"""Quality predictors: per-(query, model) quality with a robust lower bound (paper B).

Estimators (``knn``, ``gbdt``, ``irt``) are each fitted as a bootstrap ensemble
(``base.py``); the lower bound is calibrated by split conformal (``calibration.py``);
``QualityPredictor`` bundles features, ensemble, calibration, output-length predictor
and prices into one versioned artefact (``save`` / ``load_predictor``).
"""

from routing.quality.base import QualityEstimate, bootstrap_weights
from routing.quality.calibration import conformal_kappa, coverage
from routing.quality.predictor import (
    ARTEFACT_VERSION,
    ESTIMATORS,
    ArtefactError,
    QualityPredictor,
    load_predictor,
    make_estimator,
    train_predictor,
)

__all__ = [
    "ARTEFACT_VERSION",
    "ESTIMATORS",
    "ArtefactError",
    "QualityEstimate",
    "QualityPredictor",
    "bootstrap_weights",
    "conformal_kappa",
    "coverage",
    "load_predictor",
    "make_estimator",
    "train_predictor",
]
