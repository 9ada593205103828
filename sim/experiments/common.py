"""What every experiment shares: its inputs and result, the offline predictions on
held-out queries, the batch harness (paper B's window ILP on one batch, scored on
realised outcomes), the simulator set-up (cached predictors, policies built the way the
service builds them, workloads) and the shared tail (``finish``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from routing.datasets import RoutingData, split_by_query
from routing.ilp.problem import BatchProblem
from routing.ilp.solve import solve
from routing.profiles import Profiles
from routing.quality import QualityEstimate, QualityPredictor, train_predictor
from routing.types import Router
from schemas import ClusterConfig
from sim import report
from sim.cluster import SimCluster
from sim.evaluator import EvalConfig, EvalResult, evaluate
from sim.traffic import SloSpec, Trace, Workload, build_workload, load_trace, rows_by_prefix_root

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Progress = Callable[[str], None]


class ExperimentError(ValueError):
    """Bad experiment inputs; the message names what was wrong."""


class DataLoader(Protocol):
    """Reads one routing data source into the wide view (``offline.datasets``)."""

    def __call__(self, path: Path, format: str, models_csv: Path | None = None) -> RoutingData: ...


@dataclass(frozen=True)
class ExperimentInputs:
    """Where the data is and how big a run to make."""

    data_path: Path
    data_format: str
    models_csv: Path | None
    cluster_path: Path
    out_dir: Path
    trace_path: Path | None = None
    quick: bool = False
    seed: int = 0
    command: str = ""
    replicates: int | None = None  # bootstrap replicates (default: 8 quick, 20 full)
    estimator: str = "gbdt"  # the quality estimator of every experiment but ``robust``
    # text features of the predictors: a name, or a Featurizer (a MiniLM one is built by the
    # shell with its ``loaders.minilm`` source: this room reads no weights)
    featurizer: Any = "hashed"
    tag: str = ""  # appended to output file names (e.g. "-irt_router_ccf20-quick")
    # paper A's δ of latency-aware and batch-ilp-sfs in ``ontime`` (None: each policy's default)
    delta: float | None = None
    seeds: int | None = None  # ``ontime``: traffic seeds from ``seed`` on (None: 3, quick 2)
    # ``robust`` only: serve a task mix unlike the training mix (``robust.shifted_mix``)
    shift: tuple[str, ...] = ()  # tasks cut from training and over-represented when served
    shift_keep: float = 0.05  # share of the shift tasks' training queries kept
    shift_labelled: float = 0.4  # share of the served queries labelled for recalibration
    # Reads ``data_path`` (``offline.datasets.load_routing_data``): the shell passes the
    # reader in, so this room reads no data file itself.
    loader: DataLoader | None = None
    # The step-time profiles the cluster's models name (``loaders.profiles.profiles_for``),
    # read by the shell like ``loader``; None: the cluster names none.
    profiles: Profiles | None = None

    def png(self, name: str) -> Path:
        """Where experiment ``name`` writes its plot."""
        return self.out_dir / f"{name}{self.tag}.png"


@dataclass
class ExperimentResult:
    name: str
    json: dict[str, Any]
    rows: list[dict[str, Any]]
    columns: list[tuple[str, str]]
    png: Path
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def markdown(self) -> str:
        return report.markdown_table(self.rows, self.columns)


def finish(
    name: str,
    out: dict[str, Any],
    rows: list[dict[str, Any]],
    columns: Sequence[tuple[str, str]],
    png: Path,
    started_s: float,
    *,
    pct: Iterable[str] = (),
    notes: Sequence[str] = (),
) -> ExperimentResult:
    """The tail every experiment shares: the ``pct`` columns of ``rows`` written as
    percentages (after the JSON and the plot took their numbers), the result with its wall
    time since ``started_s`` (``time.perf_counter``)."""
    keys = tuple(pct)
    for r in rows:
        for k in keys:
            r[k] = report.pct(r[k])
    return ExperimentResult(
        name, out, rows, list(columns), png, list(notes), time.perf_counter() - started_s
    )


# ----------------------------------------------------------------------- setup


@dataclass
class Offline:
    """Held-out queries with predictions and realised outcomes, ``[n, m]`` arrays."""

    test: RoutingData
    mean: FloatArray
    lower: FloatArray  # the robust value the predictor ships (chosen on its calibration queries)
    boot_lower: FloatArray  # (1 − level) quantile of the bootstrap replicates (paper B's bound)
    c_hat: FloatArray  # predicted cost
    scores: FloatArray  # realised score (nan -> 0)
    cost: FloatArray  # realised cost
    predictor: QualityPredictor
    std: FloatArray  # bootstrap spread


def load_data(inputs: ExperimentInputs) -> RoutingData:
    if inputs.loader is None:
        raise ExperimentError(
            "ExperimentInputs.loader is not set: pass offline.datasets.load_routing_data"
        )
    return inputs.loader(inputs.data_path, inputs.data_format, inputs.models_csv)


def split(data: RoutingData, seed: int) -> tuple[RoutingData, RoutingData]:
    return split_by_query(data, 0.3, seed)


def replicates(inputs: ExperimentInputs) -> int:
    """Bootstrap replicates of the quality predictors (fewer in quick runs)."""
    return inputs.replicates or (8 if inputs.quick else 20)


def offline(
    train: RoutingData,
    test: RoutingData,
    estimator: str,
    n_replicates: int,
    seed: int,
    level: float = 0.9,
    featurizer: Any = "hashed",
) -> Offline:
    """Train ``estimator`` on ``train``; predict quality, length and cost on ``test``."""
    pred = train_predictor(
        train, estimator, featurizer=featurizer, n_replicates=n_replicates, level=level, seed=seed
    )
    return predict_offline(pred, test)


def predict_offline(pred: QualityPredictor, test: RoutingData) -> Offline:
    """``pred``'s quality, length and cost predictions on ``test``, beside its outcomes."""
    X = pred.features(test.texts)
    est = pred.predict_features(X)
    boot = pred.bootstrap_lower(X)
    out_tok = pred.predict_output_tokens(test.texts, test.prompt_tokens)
    c_hat = pred.predict_cost_usd(test.prompt_tokens, out_tok)
    scores = np.nan_to_num(test.scores, nan=0.0)
    return Offline(
        test, est.mean, est.lower, boot, c_hat, scores, test.realised_cost_usd(), pred, est.std
    )


def offline_for(
    inputs: ExperimentInputs, estimator: str | None = None
) -> tuple[RoutingData, Offline]:
    """The data and the offline predictions on its held-out split, by ``inputs``' estimator
    (or ``estimator``), replicates, seed and featurizer."""
    data = load_data(inputs)
    train, test = split(data, inputs.seed)
    off = offline(
        train,
        test,
        estimator or inputs.estimator,
        replicates(inputs),
        inputs.seed,
        featurizer=inputs.featurizer,
    )
    return data, off


def best_single(scores: FloatArray, cost: FloatArray) -> tuple[int, float, float]:
    """Index, mean quality and mean cost per query of the best single model."""
    q = scores.mean(axis=0)
    j = int(np.argmax(q))
    return j, float(q[j]), float(cost[:, j].mean())


# -------------------------------------------------------------- batch harness


def solve_batch(
    a: FloatArray, c_hat: FloatArray, budget_usd: float, capacity: IntArray | None = None
) -> IntArray:
    """Paper B's window ILP on one batch (``routing.ilp``); -1 = deferred."""
    n, m = a.shape
    cap = np.full(m, n, dtype=np.int64) if capacity is None else capacity
    sol = solve(
        BatchProblem(utility=a, cost_usd=c_hat, capacity=cap, budget_usd=budget_usd), "fast"
    )
    return np.asarray(sol.assignment, dtype=np.int64)


@dataclass(frozen=True)
class BatchOutcome:
    quality: float  # realised mean score over all queries (deferred = 0)
    spend_usd: float
    breaches: int  # batches whose realised spend broke the batch budget
    worst_over: float  # worst realised overspend as a share of the batch budget
    deferred: int
    per_batch_spend: FloatArray


def score_batches(
    picks: Sequence[IntArray],
    batches: Sequence[IntArray],
    scores: FloatArray,
    cost: FloatArray,
    budget_usd: float,
) -> BatchOutcome:
    q_tot, spend_tot, breaches, worst, deferred, n = 0.0, 0.0, 0, 0.0, 0, 0
    per: list[float] = []
    for pick, rows in zip(picks, batches, strict=True):
        ok = pick >= 0
        q_tot += float(scores[rows[ok], pick[ok]].sum())
        s = float(cost[rows[ok], pick[ok]].sum())
        spend_tot += s
        per.append(s)
        if s > budget_usd * (1 + 1e-9):
            breaches += 1
            worst = max(worst, s / budget_usd - 1)
        deferred += int((~ok).sum())
        n += rows.size
    return BatchOutcome(q_tot / max(n, 1), spend_tot, breaches, worst, deferred, np.asarray(per))


def make_batches(order: IntArray, batch_size: int) -> list[IntArray]:
    k = order.size // batch_size
    return [order[b * batch_size : (b + 1) * batch_size] for b in range(k)]


# ------------------------------------------------------------ simulator runs


class CachedQuality:
    """A quality predictor with its answers for known texts computed once, in one batch.

    The predictor is deterministic, so routing decisions are identical; what changes is
    the decision time: per-window featurisation (≈ 10 ms a window for the hashed n-gram
    features, whatever the window size) is paid once per text instead of per window.
    Unknown texts fall through to the predictor.
    """

    def __init__(self, predictor: QualityPredictor, texts: Sequence[str]) -> None:
        self.predictor = predictor
        self.models = list(predictor.models)
        uniq = list(dict.fromkeys(texts))
        est = predictor.predict(uniq)
        self._row = {t: i for i, t in enumerate(uniq)}
        self._mean = np.asarray(est.mean)
        self._lower = np.asarray(est.lower)
        self._std = np.asarray(est.std)

    def predict(self, texts: Sequence[str]) -> QualityEstimate:
        rows = [self._row.get(t, -1) for t in texts]
        if min(rows, default=0) < 0:
            out: QualityEstimate = self.predictor.predict(texts)
            return out
        idx = np.asarray(rows, dtype=np.int64)
        return QualityEstimate(mean=self._mean[idx], lower=self._lower[idx], std=self._std[idx])


class OracleQuality:
    """Realised scores as the quality "prediction" (mean = lower = the score, std 0): what
    a policy reaches when the predictor is not the limit. A reference, not a method; texts
    that several queries share get their mean score."""

    def __init__(self, data: RoutingData) -> None:
        self.models = list(data.models)
        uniq = list(dict.fromkeys(data.texts))
        self._row = {t: i for i, t in enumerate(uniq)}
        idx = np.fromiter((self._row[t] for t in data.texts), np.int64, len(data.texts))
        scores = np.nan_to_num(data.scores, nan=0.0)
        total = np.zeros((len(uniq), scores.shape[1]))
        np.add.at(total, idx, scores)
        self._mean = total / np.bincount(idx, minlength=len(uniq))[:, None]

    def predict(self, texts: Sequence[str]) -> QualityEstimate:
        missing = [t for t in texts if t not in self._row]
        if missing:
            raise ExperimentError(f"oracle quality has no score for {len(missing)} text(s)")
        m = self._mean[np.fromiter((self._row[t] for t in texts), np.int64, len(texts))]
        return QualityEstimate(mean=m, lower=m, std=np.zeros_like(m))


class CachedLength:
    """Output-length predictions for known (text, prompt tokens) pairs, computed once."""

    def __init__(self, length: Any, texts: Sequence[str], prompt_tokens: IntArray) -> None:
        self.length = length
        self.models = list(length.models)
        pred = np.asarray(length.predict(list(texts), np.asarray(prompt_tokens, dtype=np.int64)))
        self._row = {
            (t, int(p)): i for i, (t, p) in enumerate(zip(texts, prompt_tokens, strict=True))
        }
        self._pred = pred

    def predict(self, texts: Sequence[str], prompt_tokens: IntArray) -> FloatArray:
        rows = [self._row.get((t, int(p)), -1) for t, p in zip(texts, prompt_tokens, strict=True)]
        if min(rows, default=0) < 0:
            out: FloatArray = self.length.predict(texts, prompt_tokens)
            return out
        return self._pred[np.asarray(rows, dtype=np.int64)]


def make_policy(
    name: str,
    cluster: ClusterConfig,
    predictor: Any,
    utility_lambda: float = 0.0,
    length: Any = None,
    prefix_aware: bool = True,
    profiles: Profiles | None = None,
    **knobs: Any,
) -> Router:
    """A router from the policy registry (``routing.policies``), built the way the service
    builds it: ``RouterContext.build`` over the cluster, the quality predictor and its
    length predictor, paper A's λ; policy knobs (``delta``, ``robust``, ``method`` …) go
    to ``make_router``."""
    from routing import policies

    if length is None:
        base = predictor.predictor if isinstance(predictor, CachedQuality) else predictor
        length = getattr(base, "length", None)
    ctx = policies.RouterContext.build(
        cluster,
        predictor,
        length=length,
        lam_per_usd=utility_lambda,
        prefix_aware=prefix_aware,
        profiles=profiles,
    )
    router: Router = policies.make_router(name, ctx, **knobs)
    return router


def sample_lengths(
    trace: Trace | None, n: int, rng: np.random.Generator
) -> tuple[IntArray | None, IntArray | None]:
    """(input, output) token pairs drawn from a trace's rows, to give synthetic arrivals
    realistic request sizes; ``(None, None)`` without a trace (dataset sizes are used)."""
    if trace is None or trace.n == 0:
        return None, None
    idx = rng.integers(0, trace.n, size=n)
    return trace.input_tokens[idx], trace.output_tokens[idx]


def workload_for(
    data: RoutingData,
    arrival_s: FloatArray,
    slo: SloSpec,
    rng: np.random.Generator,
    *,
    lengths_from: Trace | None = None,
    replay: Trace | None = None,
    name: str = "",
) -> Workload:
    """Arrivals joined to the dataset's queries. ``replay``: the trace whose arrivals these
    are (its token counts go with them); ``lengths_from``: a trace to sample sizes from."""
    t_in: IntArray | None
    t_out: IntArray | None
    rows = None
    hashes = replay.hash_ids if replay is not None else None
    if replay is not None:
        t_in, t_out = replay.input_tokens, replay.output_tokens
    else:
        t_in, t_out = sample_lengths(lengths_from, arrival_s.size, rng)
    if hashes is not None:  # a conversation keeps its text (sim.traffic.rows_by_prefix_root)
        rows = rows_by_prefix_root(hashes, len(data.texts), rng)
    return build_workload(
        arrival_s,
        data.scores,
        data.texts,
        data.tasks,
        data.models,
        data.prompt_tokens,
        data.output_tokens,
        slo,
        rng,
        trace_input_tokens=t_in,
        trace_output_tokens=t_out,
        name=name,
        rows=rows,
        prefix_hashes=hashes,
        prefix_block_tokens=replay.hash_block_tokens if replay is not None else 512,
    )


def simulate(
    router: Router,
    cluster: ClusterConfig,
    workload: Workload,
    config: EvalConfig,
    seed: int,
    progress: Callable[[int, int], None] | None = None,
    profiles: Profiles | None = None,
) -> EvalResult:
    """One policy over one workload on a fresh simulated cluster."""
    sim = SimCluster(cluster, seed=seed, profiles=profiles)
    return evaluate(router, sim, workload, config, progress=progress)


ONTIME_POLICIES = (
    "round-robin",
    "shortest-queue",
    "latency-agnostic",
    "latency-aware",
    "batch-ilp-sfs",
)
BASELINES = ("round-robin", "shortest-queue", "latency-agnostic")
DELTA_POLICIES = ("latency-aware", "batch-ilp-sfs")
"""The policies with paper A's latency penalty δ (the experiments' ``delta`` sets both)."""
UTILITY_LAMBDA = 20.0
"""Quality per USD in u = score − λ·cost for the simulator experiments: at dc9 prices a
1,400-token query costs 0.025 utility on a 49–70B model and 0.006 on a 7B model."""
ONTIME_SLO = "lognormal:400,0.5"
"""TTFT SLOs: median 400 ms, log-normal spread (a 1,100-token prefill on the 34B-class
instance takes ~100–150 ms, so two or three queued prefills break the median SLO)."""


def sim_eval_config() -> EvalConfig:
    """The simulator settings of the simulator experiments: 50 ms windows of at most 64
    queries, paper A's λ."""
    return EvalConfig(window_s=0.05, max_batch=64, utility_lambda=UTILITY_LAMBDA)


@dataclass(frozen=True)
class SimSetup:
    cluster: ClusterConfig
    data: RoutingData  # held-out queries the traffic draws from
    predictor: QualityPredictor
    quality: CachedQuality  # the predictor's answers on ``data``, computed once
    lengths: Trace | None
    profiles: Profiles | None = None  # the step-time profiles the cluster names


def sim_setup(inputs: ExperimentInputs) -> SimSetup:
    data = load_data(inputs)
    train, test = split(data, inputs.seed)
    cluster = ClusterConfig.from_file(inputs.cluster_path)
    pred = train_predictor(
        train,
        inputs.estimator,
        featurizer=inputs.featurizer,
        n_replicates=replicates(inputs),
        seed=inputs.seed,
    )
    lengths = (
        load_trace(inputs.trace_path)
        if inputs.trace_path is not None and inputs.trace_path.exists()
        else None
    )
    return SimSetup(cluster, test, pred, CachedQuality(pred, test.texts), lengths, inputs.profiles)
