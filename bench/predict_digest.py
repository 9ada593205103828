"""Digest of the default quality predictor's features and predictions, bit for bit.

    .venv/bin/python bench/predict_digest.py --artefact P.npz   # one line: texts and SHA-256

Featurises and predicts (no memo, 1,000 texts a call, one BLAS thread) every text of the
vendored dc9 data plus a few edge cases (empty, long, non-ASCII, digits and newlines) with
the artefact given, and hashes the features and the mean, lower bound and spread of every
prediction. Run it from two trees (a change and its base) with the same artefact: equal
digests mean the change predicts the same to the last bit on this machine. Without
``--artefact`` it takes the demo predictor (``offline.demo_predictor``), trained first if
missing; that artefact's name holds a fingerprint of the training code, so two trees that
differ there train their own (compare those files too: equal bytes, the same training).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.predictor import load_predictor  # noqa: E402
from offline.blas import limit_blas_threads  # noqa: E402
from offline.datasets import load_routing_data  # noqa: E402
from offline.demo_predictor import DEMO_DATA, ensure_predictor  # noqa: E402
from offline.predictor import DEFAULT_RECIPE  # noqa: E402

EDGE_TEXTS = ["", " ", "Ünïcödé ß İstanbul", "a" * 5000, "x\n\n\ny 123 456"]
CHUNK = 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artefact", type=Path, help="predictor artefact (.npz); default: the demo's")
    args = ap.parse_args()
    limit_blas_threads(1)
    path = args.artefact or ensure_predictor()
    predictor = load_predictor(path)  # features and predict_features: no memo
    texts = list(load_routing_data(DEMO_DATA, DEFAULT_RECIPE.format).texts) + EDGE_TEXTS
    h = hashlib.sha256()
    for start in range(0, len(texts), CHUNK):
        X = predictor.features(texts[start : start + CHUNK])
        est = predictor.predict_features(X)
        for arr in (X, est.mean, est.lower, est.std):
            h.update(np.ascontiguousarray(arr).tobytes())
    print(f"{len(texts)} texts  {h.hexdigest()}  ({path.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
