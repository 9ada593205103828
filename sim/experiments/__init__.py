"""Paper reproductions on real data (issue 6), one module per experiment:

- ``ontime`` (paper A, "Metric: OnTimeUtility"): OnTimeUtility vs arrival rate in the
  simulator for round-robin, shortest-queue, latency-agnostic, per-query SFS and batch
  ILP + SFS, under Poisson and MMPP arrivals; AUC gain over the best baseline (+33%).
- ``tradeoff`` (paper A, Lagrangian δ): utility vs SLO attainment of per-query SFS as δ
  varies, with the baselines as points.
- ``batching`` (paper B, "Batch ILP" vs per-query): equal money, random vs adversarial
  batches (up to +4% random, +24% adversarial, per-query breaks budgets).
- ``robust`` (paper B, "Robustness"): batch ILP on the lower bound vs on the point
  estimate, per estimator (kNN, GBDT, IRT), at tight budgets (+1–14%).
- ``allocation`` (paper B, "Offline instance allocation"): instance counts chosen on
  historical windows (``routing.allocation``) vs uniform counts under a GPU budget.
- ``prefix``: prefix-aware vs prefix-agnostic routing on the Mooncake trace and ShareGPT.

Every experiment returns an ``ExperimentResult``: a JSON-ready dict (keys as issue 6
names them), markdown table rows and a PNG (``common.finish`` writes that tail). Offline
experiments (batching, robust, allocation) solve paper B's window problem with
``routing.ilp.solve`` — the solver the batch policies call — on predicted quality and
predicted cost and score the choices on realised scores and realised cost; the
simulator experiments (ontime, tradeoff, prefix) run the policies of
``routing.policies`` through ``sim.evaluator``.
"""

from __future__ import annotations

from collections.abc import Callable

from routing.quality.evaluate import lambda_for_budget, route_per_query
from sim.experiments.allocation import (
    allocate_counts,
    route_windows,
    run_allocation,
    uniform_counts,
)
from sim.experiments.batching import per_query_enforced, run_batching
from sim.experiments.common import (
    BASELINES,
    DELTA_POLICIES,
    ONTIME_POLICIES,
    ONTIME_SLO,
    UTILITY_LAMBDA,
    BatchOutcome,
    CachedLength,
    CachedQuality,
    DataLoader,
    ExperimentError,
    ExperimentInputs,
    ExperimentResult,
    Offline,
    OracleQuality,
    Progress,
    SimSetup,
    best_single,
    load_data,
    make_batches,
    make_policy,
    offline,
    replicates,
    score_batches,
    sim_setup,
    simulate,
    solve_batch,
    split,
    workload_for,
)
from sim.experiments.ontime import run_ontime
from sim.experiments.prefix import run_prefix
from sim.experiments.robust import run_robust
from sim.experiments.tradeoff import TRADEOFF_DELTAS, run_tradeoff

Runner = Callable[[ExperimentInputs, Progress | None], ExperimentResult]

RUNNERS: dict[str, Runner] = {
    "ontime": run_ontime,
    "batching": run_batching,
    "robust": run_robust,
    "allocation": run_allocation,
    "tradeoff": run_tradeoff,
    "prefix": run_prefix,
}
EXPERIMENTS = tuple(RUNNERS)


def run(name: str, inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    """Run experiment ``name`` (one of ``EXPERIMENTS``)."""
    if name not in RUNNERS:
        raise ExperimentError(
            f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}"
        )
    return RUNNERS[name](inputs, progress)


__all__ = [
    "BASELINES",
    "DELTA_POLICIES",
    "EXPERIMENTS",
    "ONTIME_POLICIES",
    "ONTIME_SLO",
    "RUNNERS",
    "TRADEOFF_DELTAS",
    "UTILITY_LAMBDA",
    "BatchOutcome",
    "CachedLength",
    "CachedQuality",
    "DataLoader",
    "ExperimentError",
    "ExperimentInputs",
    "ExperimentResult",
    "Offline",
    "OracleQuality",
    "Progress",
    "Runner",
    "SimSetup",
    "allocate_counts",
    "best_single",
    "lambda_for_budget",
    "load_data",
    "make_batches",
    "make_policy",
    "offline",
    "per_query_enforced",
    "replicates",
    "route_per_query",
    "route_windows",
    "run",
    "run_allocation",
    "run_batching",
    "run_ontime",
    "run_prefix",
    "run_robust",
    "run_tradeoff",
    "score_batches",
    "sim_setup",
    "simulate",
    "solve_batch",
    "split",
    "uniform_counts",
    "workload_for",
]
