"""The quality predictor the routers load: features -> bootstrap ensemble -> mean and
robust lower bound, plus the output-length predictor and model prices, in one
versioned artefact file.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.cost import cost_usd, estimate_prompt_tokens
from routing.datasets import DEFAULT_OUTPUT_TOKENS, RoutingData, split_by_query
from routing.features import Featurizer, featurizer_from_state, make_featurizer
from routing.length import LengthPredictor
from routing.minilm import MiniLMSource
from routing.quality.base import QualityEstimate, ReplicateEstimator
from routing.quality.calibration import conformal_kappa, coverage, nonconformity
from routing.quality.gbdt import GBDTEstimator
from routing.quality.irt import IRTEstimator
from routing.quality.knn import KNNEstimator
from routing.quality.memo import PredictionMemo, text_key
from routing.quality.robustness import RobustSpec, Selection, select_robustness
from routing.types import FloatArray, IntArray

ARTEFACT_FORMAT = "switchyard-quality-predictor"
ARTEFACT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no stored robust spec (routes on the conformal bound at ``level``)
ESTIMATORS = ("knn", "gbdt", "irt")

Float32Array = npt.NDArray[np.float32]


def text_hashes(texts: Sequence[str]) -> npt.NDArray[np.uint64]:
    """64-bit content hash per text (leakage checks between training and evaluation)."""
    return np.fromiter(
        (
            int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little")
            for t in texts
        ),
        np.uint64,
        len(texts),
    )


class ArtefactError(ValueError):
    """An artefact file that is not a predictor this code can load."""


def make_estimator(
    name: str, semantic_dims: int | None = None, **kwargs: Any
) -> ReplicateEstimator:
    if name == "knn":
        return KNNEstimator(semantic_dims=semantic_dims, **kwargs)
    if name == "gbdt":
        return GBDTEstimator(**kwargs)
    if name == "irt":
        return IRTEstimator(**kwargs)
    raise ValueError(f"unknown estimator {name!r}; expected one of {', '.join(ESTIMATORS)}")


def _estimator_from_state(
    name: str, params: dict[str, Any], arrays: dict[str, npt.NDArray[Any]]
) -> Any:
    cls: Any = {"knn": KNNEstimator, "gbdt": GBDTEstimator, "irt": IRTEstimator}.get(name)
    if cls is None:
        raise ArtefactError(f"unknown estimator {name!r} in artefact")
    try:
        return cls.from_state(params, arrays)
    except (KeyError, ValueError) as e:
        raise ArtefactError(f"estimator {name!r}: {e}") from None


@dataclass
class QualityPredictor:
    """Per-(query, model) quality with a calibrated robust lower bound.

    ``lower`` is the robust value the routers see, ``robust.lower(mean, std, s0)``:
    chosen on calibration data by ``train_predictor`` (``robustness.py``; often the
    point estimate itself) and stored in the artefact. ``level`` is the nominal coverage
    of the conformal interval ``conformal_lower``: P(realised score >= it) >= level on
    exchangeable queries. ``with_level`` routes on that interval instead, ``with_robust``
    on any spec (no retraining: the calibration scores are kept).
    """

    models: list[str]
    featurizer: Any
    estimator: Any
    level: float
    calibration_scores: FloatArray  # sorted nonconformity scores of the calibration pairs
    s0: float
    length: LengthPredictor
    input_usd_per_token: FloatArray
    output_usd_per_token: FloatArray
    meta: dict[str, Any] = field(default_factory=dict)
    seen_text_hashes: npt.NDArray[np.uint64] = field(default_factory=lambda: np.zeros(0, np.uint64))
    robust: RobustSpec | None = None  # None: the conformal bound at ``level`` (version-1 artefacts)
    # texts whose predictions ``predict`` keeps (``memo.PredictionMemo``); 0: none kept
    memo_size: int = 65_536

    def __post_init__(self) -> None:
        if self.memo_size < 0:
            raise ValueError(f"memo_size must be >= 0, got {self.memo_size}")
        self._memo = PredictionMemo(self.memo_size, len(self.models)) if self.memo_size else None
        self.kappa = conformal_kappa(self.calibration_scores, self.level)
        if self.robust is None:
            self.robust = RobustSpec("conformal", kappa=self.kappa, level=self.level)
        if self.robust.kind == "per-model" and len(self.robust.offset_per_model) != len(self.models):
            raise ValueError(
                f"robust spec has {len(self.robust.offset_per_model)} per-model offsets for "
                f"{len(self.models)} models"
            )
        self.length.featurizer = self.featurizer

    @property
    def n_replicates(self) -> int:
        if "n_replicates" in self.meta:
            return int(self.meta["n_replicates"])
        probe = np.zeros((1, self.featurizer.dim), np.float32)
        return int(self.predict_replicates(probe).shape[0])

    def with_level(self, level: float) -> QualityPredictor:
        """The same predictor routing on its conformal bound at nominal ``level``."""
        kappa = conformal_kappa(self.calibration_scores, level)
        return self._with(level, RobustSpec("conformal", kappa=kappa, level=level))

    def with_robust(self, spec: RobustSpec) -> QualityPredictor:
        """The same predictor routing on ``spec`` (e.g. re-selected on new data)."""
        return self._with(self.level, spec)

    def _with(self, level: float, spec: RobustSpec) -> QualityPredictor:
        return QualityPredictor(
            models=self.models,
            featurizer=self.featurizer,
            estimator=self.estimator,
            level=level,
            calibration_scores=self.calibration_scores,
            s0=self.s0,
            length=self.length,
            input_usd_per_token=self.input_usd_per_token,
            output_usd_per_token=self.output_usd_per_token,
            meta=dict(self.meta),
            seen_text_hashes=self.seen_text_hashes,
            robust=spec,
            memo_size=self.memo_size,
        )

    def seen(self, texts: Sequence[str]) -> npt.NDArray[np.bool_]:
        """Which texts were among the training (fit or calibration) queries."""
        out: npt.NDArray[np.bool_] = np.isin(text_hashes(texts), self.seen_text_hashes)
        return out

    # ------------------------------------------------------------------ predicting

    def features(self, texts: Sequence[str]) -> Float32Array:
        out: Float32Array = self.featurizer.transform(texts)
        return out

    def predict_replicates(self, X: Float32Array) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = self.estimator.predict_replicates(X)
        return out

    def predict_features(self, X: Float32Array) -> QualityEstimate:
        """Quality of ``n`` featurised queries on every model, ``[n, m]`` arrays."""
        R = self.predict_replicates(np.asarray(X, dtype=np.float32))
        mean = R.mean(axis=0, dtype=np.float64)
        std = R.std(axis=0, dtype=np.float64)
        assert self.robust is not None
        return QualityEstimate(mean=mean, lower=self.robust.lower(mean, std, self.s0), std=std)

    def conformal_lower(self, est: QualityEstimate) -> FloatArray:
        """The conformal lower bound at ``level`` (coverage >= level), whatever ``robust`` is."""
        out: FloatArray = est.mean - self.kappa * (est.std + self.s0)
        return out

    def predict(self, texts: Sequence[str]) -> QualityEstimate:
        """``predict_features(features(texts))``; a text seen before (and still in the memo)
        takes its memoised rows, equal to float32 rounding (``memo.py``), and a text twice in
        ``texts`` is predicted once."""
        memo = self._memo
        if memo is None or not texts:
            return self.predict_features(self.features(texts))
        keys = [text_key(t) for t in texts]
        slot = memo.lookup(keys)
        miss = np.flatnonzero(slot < 0)
        memo.hits += len(texts) - miss.size
        memo.misses += miss.size
        if miss.size == len(texts) and len(set(keys)) == len(keys):
            est = self.predict_features(self.features(texts))
            memo.store(keys, est.mean, est.lower, est.std)
            return est
        m = len(self.models)
        mean, lower, std = (
            np.empty((len(texts), m)),
            np.empty((len(texts), m)),
            np.empty((len(texts), m)),
        )
        hit = slot >= 0
        mean[hit], lower[hit], std[hit] = (
            memo.mean[slot[hit]],
            memo.lower[slot[hit]],
            memo.std[slot[hit]],
        )
        if miss.size:
            first: dict[bytes, int] = {}  # a missing text's position among the unique ones
            rows: list[int] = []
            for i in miss.tolist():
                if keys[i] not in first:
                    first[keys[i]] = len(rows)
                    rows.append(i)
            est = self.predict_features(self.features([texts[i] for i in rows]))
            at = np.fromiter((first[keys[i]] for i in miss.tolist()), np.int64, miss.size)
            mean[miss], lower[miss], std[miss] = est.mean[at], est.lower[at], est.std[at]
            memo.store(list(first), est.mean, est.lower, est.std)
        return QualityEstimate(mean=mean, lower=lower, std=std)

    def bootstrap_lower(self, X: Float32Array) -> FloatArray:
        """Uncalibrated robust value: the (1 - level) quantile over bootstrap replicates."""
        R = self.predict_replicates(np.asarray(X, dtype=np.float32))
        out: FloatArray = np.quantile(R, 1.0 - self.level, axis=0).astype(np.float64)
        return out

    def predict_output_tokens(
        self, texts: Sequence[str], prompt_tokens: IntArray | None = None
    ) -> FloatArray:
        p = estimate_prompt_tokens(texts) if prompt_tokens is None else prompt_tokens
        return self.length.predict(texts, p)

    def predict_cost_usd(self, prompt_tokens: IntArray, output_tokens: FloatArray) -> FloatArray:
        return cost_usd(
            prompt_tokens, output_tokens, self.input_usd_per_token, self.output_usd_per_token
        )

    # ------------------------------------------------------------------ artefact

    def to_bytes(self) -> bytes:
        """The artefact: one ``.npz`` (no pickle), a JSON header plus named arrays
        (``loaders.predictor.save_predictor`` writes it to a file)."""
        fname = self.featurizer.name
        fparams, farrays = self.featurizer.state()
        eparams, earrays = self.estimator.state()
        lparams, larrays = self.length.state()
        header = {
            "format": ARTEFACT_FORMAT,
            "version": ARTEFACT_VERSION,
            "models": self.models,
            "level": self.level,
            "s0": self.s0,
            "featurizer": {"name": fname, "params": fparams},
            "estimator": {"name": self.estimator.name, "params": eparams},
            "length": lparams,
            "robust": None if self.robust is None else self.robust.to_json(),
            "meta": self.meta,
        }
        arrays: dict[str, npt.NDArray[Any]] = {
            "header": np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8),
            "calibration_scores": self.calibration_scores,
            "input_usd_per_token": self.input_usd_per_token,
            "output_usd_per_token": self.output_usd_per_token,
            "seen_text_hashes": self.seen_text_hashes,
        }
        for prefix, part in (("feat", farrays), ("est", earrays), ("len", larrays)):
            for k, v in part.items():
                arrays[f"{prefix}__{k}"] = np.asarray(v)
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
        return buf.getvalue()


def predictor_from_bytes(
    data: bytes, path: str = "<bytes>", minilm: MiniLMSource | None = None
) -> QualityPredictor:
    """Parse an artefact made by ``QualityPredictor.to_bytes``; checks format and version.
    ``path`` names where the bytes came from in errors (``loaders.predictor.load_predictor``
    reads the file); ``minilm``: what a MiniLM featurizer runs on."""
    try:
        npz = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ArtefactError(f"{path}: not a predictor artefact ({e})") from None
    with npz:
        if "header" not in npz.files:
            raise ArtefactError(f"{path}: not a predictor artefact (no header)")
        header = json.loads(bytes(npz["header"]).decode("utf-8"))
        if header.get("format") != ARTEFACT_FORMAT:
            raise ArtefactError(
                f"{path}: format {header.get('format')!r}, expected {ARTEFACT_FORMAT!r}"
            )
        if header.get("version") not in READABLE_VERSIONS:
            raise ArtefactError(
                f"{path}: artefact version {header.get('version')}, this code reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; "
                "retrain with `switchyard train`"
            )
        arrays = {k: npz[k] for k in npz.files}

    def part(prefix: str) -> dict[str, npt.NDArray[Any]]:
        p = prefix + "__"
        return {k[len(p) :]: v for k, v in arrays.items() if k.startswith(p)}

    feat = featurizer_from_state(
        header["featurizer"]["name"], header["featurizer"]["params"], part("feat"), minilm
    )
    est = _estimator_from_state(
        header["estimator"]["name"], header["estimator"]["params"], part("est")
    )
    length = LengthPredictor.from_state(header["length"], part("len"))
    return QualityPredictor(
        models=list(header["models"]),
        featurizer=feat,
        estimator=est,
        level=float(header["level"]),
        calibration_scores=arrays["calibration_scores"].astype(np.float64),
        s0=float(header["s0"]),
        length=length,
        input_usd_per_token=arrays["input_usd_per_token"].astype(np.float64),
        output_usd_per_token=arrays["output_usd_per_token"].astype(np.float64),
        meta=dict(header.get("meta", {})),
        seen_text_hashes=arrays.get("seen_text_hashes", np.zeros(0, np.uint64)).astype(np.uint64),
        robust=RobustSpec.from_json(header["robust"]) if header.get("robust") else None,
    )


def train_predictor(
    data: RoutingData,
    estimator: str = "gbdt",
    featurizer: str | Featurizer = "hashed",
    n_replicates: int = 20,
    level: float = 0.9,
    calibration_fraction: float = 0.2,
    seed: int = 0,
    estimator_kwargs: dict[str, Any] | None = None,
    robust: str | RobustSpec = "auto",
    minilm: MiniLMSource | None = None,
) -> QualityPredictor:
    """Fit features, a bootstrap ensemble and the conformal calibration on ``data``.

    The queries are split (by query) into a fitting part and a calibration part of
    ``calibration_fraction``; the featurizer is fitted on the fitting texts only.
    ``robust``: ``auto`` selects the robust value on the calibration queries
    (``robustness.select_robustness``: the point estimate unless a bound routes better
    there), ``conformal`` routes on the conformal bound at ``level`` (issue 4's rule),
    ``point`` on the mean, or a given ``RobustSpec``.
    """
    if n_replicates < 2:
        raise ValueError(f"n_replicates must be >= 2 for a bootstrap interval, got {n_replicates}")
    if isinstance(robust, str) and robust not in ("auto", "conformal", "point"):
        raise ValueError(f"robust must be auto, conformal, point or a RobustSpec, got {robust!r}")
    fit_part, cal_part = split_by_query(data, calibration_fraction, seed)
    feat: Any = (
        make_featurizer(featurizer, minilm=minilm) if isinstance(featurizer, str) else featurizer
    )
    feat.fit(fit_part.texts)
    X_fit = feat.transform(fit_part.texts)
    X_cal = feat.transform(cal_part.texts)
    est = make_estimator(estimator, semantic_dims=feat.semantic_dims, **(estimator_kwargs or {}))
    est.fit(X_fit, fit_part.scores, n_replicates, seed)
    R = est.predict_replicates(X_cal)
    mean = R.mean(axis=0, dtype=np.float64)
    std = R.std(axis=0, dtype=np.float64)
    s0 = float(max(np.median(std), 1e-3))
    scores = np.sort(nonconformity(mean, std, cal_part.scores, s0))
    length = LengthPredictor(data.models, DEFAULT_OUTPUT_TOKENS)
    X_all = np.vstack([X_fit, X_cal])
    out_tok = np.vstack([fit_part.output_tokens, cal_part.output_tokens])
    prompt = np.concatenate([fit_part.prompt_tokens, cal_part.prompt_tokens])
    length.fit(out_tok, prompt, X_all)
    pin = np.nan_to_num(data.input_usd_per_token, nan=0.0)
    pout = np.nan_to_num(data.output_usd_per_token, nan=0.0)
    selection: Selection | None = None
    if isinstance(robust, RobustSpec):
        spec = robust
    elif robust == "point":
        spec = RobustSpec()
    elif robust == "conformal":
        spec = RobustSpec("conformal", kappa=conformal_kappa(scores, level), level=level)
    else:
        c_hat_cal = cost_usd(
            cal_part.prompt_tokens,
            length.predict_features(cal_part.prompt_tokens, X_cal),
            pin,
            pout,
        )
        selection = select_robustness(
            mean, std, cal_part.scores, c_hat_cal, cal_part.realised_cost_usd(), s0, seed=seed
        )
        spec = selection.spec
    pred = QualityPredictor(
        models=list(data.models),
        featurizer=feat,
        estimator=est,
        level=level,
        calibration_scores=scores,
        s0=s0,
        length=length,
        input_usd_per_token=pin,
        output_usd_per_token=pout,
        meta={
            "source": data.source,
            "n_train_queries": fit_part.n,
            "n_calibration_queries": cal_part.n,
            "n_replicates": n_replicates,
            "seed": seed,
            "calibration_coverage": coverage(
                mean - conformal_kappa(scores, level) * (std + s0), cal_part.scores
            ),
            "estimator": est.name,
            "featurizer": feat.name,
            "robust_selection": None if selection is None else selection.report(),
        },
        seen_text_hashes=np.unique(text_hashes(data.texts)),
        robust=spec,
    )
    return pred


def recalibrate(
    predictor: QualityPredictor, data: RoutingData, seed: int = 0
) -> tuple[QualityPredictor, Selection]:
    """Re-select the robust value on labelled queries of the traffic served (no retraining).

    For a serving-time task mix unlike the training mix: the point estimate stays the
    default, and a per-model bias bound is taken only where it routes ``data`` better
    (``robustness.select_robustness``). Queries the predictor was trained on are dropped."""
    missing = [mdl for mdl in predictor.models if mdl not in data.models]
    if missing:
        raise ValueError(f"the data has no scores for predictor model(s) {missing}")
    data = data.select_models(predictor.models)
    fresh = np.flatnonzero(~predictor.seen(data.texts))
    if fresh.size < 20:
        raise ValueError(
            f"{fresh.size} queries the predictor was not trained on; recalibration needs >= 20"
        )
    data = data.subset(fresh)
    X = predictor.features(data.texts)
    est = predictor.predict_features(X)
    c_hat = predictor.predict_cost_usd(
        data.prompt_tokens, predictor.length.predict_features(data.prompt_tokens, X)
    )
    sel = select_robustness(
        est.mean, est.std, data.scores, c_hat, data.realised_cost_usd(), predictor.s0, seed=seed
    )
    out = predictor.with_robust(sel.spec)
    out.meta["robust_selection"] = sel.report()
    out.meta["recalibrated_on_queries"] = int(data.n)
    return out, sel
