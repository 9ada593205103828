"""Benchmark of the window ILP solvers (issue 5, item 7).

    .venv/bin/python bench/ilp.py --quick        # < 60 s, JSON list on stdout
    .venv/bin/python bench/ilp.py                # the full table of docs/benchmarks/ilp.md
    .venv/bin/python bench/ilp.py --decide       # decide() cost of every policy

Instances: n queries × m models with model abilities and query difficulties
(quality in [0, 1]), prices spread over two orders of magnitude and correlated with
ability, a binding budget (30% of the way from the cheapest to the max-quality
assignment's cost), binding capacities (the best models hold few queries) and ~10%
infeasible pairs. Each row: {n, m, method, ms_p50, ms_p99, gap, gap_to_best_bound,
reps}: ``gap`` is the largest relative gap the method itself certified (its objective
against its own proven bound), ``gap_to_best_bound`` the largest gap to the best
bound any method proved on the same instance; ms is wall time including model
building, cpu_ms this process's CPU time (less sensitive to a busy machine).
``fast`` stops at a certified gap of 0.1%; ``scip``, ``highs`` and ``fast+scip``
(SCIP started from the fast path's solution) solve to optimality (gap 1e-9).
``--quick`` runs the exact methods once per size up to n = 256, SCIP once at
1024 × 20 (the headline comparison), and skips them elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routing.ilp import BatchProblem, relative_gap, solve  # noqa: E402
from routing.ilp.solve import METHODS, Method  # noqa: E402


def make_instance(n: int, m: int, seed: int, infeasible: float = 0.1) -> BatchProblem:
    rng = np.random.default_rng(seed)
    ability = np.sort(rng.normal(0.0, 1.0, m))
    difficulty = rng.normal(0.0, 1.0, n)
    logits = 1.2 * ability[None, :] - difficulty[:, None] + rng.normal(0.0, 0.7, (n, m))
    quality = 1.0 / (1.0 + np.exp(-logits))
    price = np.exp(np.linspace(np.log(1e-7), np.log(2e-5), m) + rng.normal(0, 0.3, m))
    prompt = rng.lognormal(np.log(300), 0.8, n)
    output = rng.lognormal(np.log(200), 0.6, (n, m))
    cost = price[None, :] * (prompt[:, None] + 2.0 * output)
    feasible = rng.random((n, m)) >= infeasible
    feasible[np.arange(n), rng.integers(0, m, n)] = True
    share = np.linspace(0.5, 1.5, m)[::-1]  # best models hold fewest queries
    cap = np.ceil(1.6 * n * share / share.sum()).astype(np.int64)
    cheap = np.where(feasible, cost, np.inf).min(axis=1).sum()
    best = np.where(feasible, quality, -np.inf).argmax(axis=1)
    rich = cost[np.arange(n), best].sum()
    budget = float(cheap + 0.3 * (rich - cheap))
    return BatchProblem(quality, cost, cap, budget, feasible=feasible)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints progress lines to fd 1 from C++; keep the JSON on stdout clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def run(
    sizes: list[tuple[int, int]],
    methods: list[Method],
    reps: int,
    seed: int,
    exact_sizes: Callable[[int, int, str], bool],
    exact_reps: int,
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for n, m in sizes:
        times: dict[str, list[float]] = {meth: [] for meth in methods}
        cpu: dict[str, list[float]] = {meth: [] for meth in methods}
        objs: dict[str, list[tuple[int, float]]] = {meth: [] for meth in methods}
        certified: dict[str, list[float]] = {meth: [] for meth in methods}
        bounds: dict[int, float] = {}
        for r in range(reps):
            prob = make_instance(n, m, seed + 1000 * r + n + m)
            for meth in methods:
                exact = meth in ("scip", "highs", "fast+scip")
                if exact and (r >= exact_reps or not exact_sizes(n, m, meth)):
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                with _quiet_stdout():
                    sol = solve(prob, meth, gap_tol=1e-3 if meth == "fast" else 1e-9)
                times[meth].append((time.perf_counter() - t0) * 1e3)
                cpu[meth].append((time.process_time() - c0) * 1e3)
                bad = prob.violations(sol.assignment)
                if bad:
                    raise SystemExit(f"{meth} n={n} m={m}: infeasible answer: {bad}")
                objs[meth].append((r, sol.objective))
                certified[meth].append(sol.gap)
                bounds[r] = min(bounds.get(r, math.inf), sol.bound)
        for meth in methods:
            if not times[meth]:
                continue
            true_gaps = [relative_gap(o, bounds[r]) for r, o in objs[meth]]
            rows.append(
                {
                    "n": n,
                    "m": m,
                    "method": meth,
                    "ms_p50": round(float(np.percentile(times[meth], 50)), 3),
                    "ms_p99": round(float(np.percentile(times[meth], 99)), 3),
                    "cpu_ms_p50": round(float(np.percentile(cpu[meth], 50)), 3),
                    "gap": float(f"{max(certified[meth]):.3g}"),
                    "gap_to_best_bound": float(f"{max(true_gaps):.3g}"),
                    "reps": len(times[meth]),
                }
            )
    return rows


def decide_latency(reps: int, seed: int) -> list[dict[str, object]]:
    """decide() cost of every policy: windows of 1, 10, 50 queries on 10 instances.

    Predictors are stand-ins (fixed per-model quality and lengths) so that the figure
    is the policy's own cost plus the SFS estimator's, not the quality model's.
    """
    from dataclasses import dataclass

    from routing.policies import ROUTERS, RouterContext, make_router
    from routing.steptime import StepTimeModel
    from routing.types import Budget, InstanceState, InstanceView
    from schemas import ClusterConfig, Query

    names = ["small", "medium", "large"]

    @dataclass
    class Est:
        mean: np.ndarray
        lower: np.ndarray

    class Quality:
        models = names

        def predict(self, texts: list[str]) -> Est:
            mean = np.tile([0.5, 0.7, 0.9], (len(texts), 1)) + rng.uniform(0, 0.1, (len(texts), 3))
            return Est(mean, mean - [0.05, 0.1, 0.3])

    class Length:
        models = names

        def predict(self, texts: list[str], prompt: np.ndarray) -> np.ndarray:
            return np.tile([120.0, 160.0, 200.0], (len(texts), 1))

    rng = np.random.default_rng(seed)
    cluster = ClusterConfig.model_validate(
        {
            "models": [
                {"name": m, "input_usd_per_token": p, "output_usd_per_token": 2 * p}
                for m, p in zip(names, [1e-7, 1e-6, 1e-5], strict=True)
            ],
            "instances": [{"id": f"i{j}", "model": names[j % 3]} for j in range(10)],
        }
    )
    step = StepTimeModel(6.0, 0.03, 2e-4, 2e-6)
    ctx = RouterContext.build(cluster, Quality(), Length(), step_time={m: step for m in names})

    def view(j: int) -> InstanceView:
        r = int(rng.integers(0, 40))
        prompt = rng.integers(100, 2000, r)
        done = rng.random(r) < 0.8
        pre = np.where(done, prompt, 0)
        dec = np.where(done, rng.integers(1, 100, r), 0)
        state = InstanceState(prompt, pre, dec, dec + rng.integers(10, 300, r))
        return InstanceView(f"i{j}", names[j % 3], state, free_slots=64)

    rows: list[dict[str, object]] = []
    for name in sorted(ROUTERS):
        router = make_router(name, ctx)
        for n in (1, 10, 50):
            wall: list[float] = []
            cpu: list[float] = []
            for r in range(reps + 1):
                views = [view(j) for j in range(10)]
                qs = [
                    Query(
                        id=f"q{r}-{i}",
                        prompt="x",
                        prompt_tokens=int(rng.integers(50, 3000)),
                        ttft_slo_ms=1500.0,
                    )
                    for i in range(n)
                ]
                budget = Budget(window_usd=n * 2e-3)
                t0, c0 = time.perf_counter(), time.process_time()
                router.decide(qs, views, budget, now=float(r))
                if r:  # the first call warms caches and imports
                    wall.append((time.perf_counter() - t0) * 1e3)
                    cpu.append((time.process_time() - c0) * 1e3)
            rows.append(
                {
                    "policy": name,
                    "n": n,
                    "instances": 10,
                    "ms_p50": round(float(np.percentile(wall, 50)), 3),
                    "ms_p99": round(float(np.percentile(wall, 99)), 3),
                    "cpu_ms_p50": round(float(np.percentile(cpu, 50)), 3),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small repetitions, < 60 s")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--exact-max-n", type=int, default=4096, help="largest n for scip/highs/fast+scip"
    )
    ap.add_argument(
        "--decide",
        action="store_true",
        help="instead: decide() cost of every policy (10 instances)",
    )
    args = ap.parse_args()
    ns = [64, 256, 1024, 4096]
    ms = [11, 20]
    if args.decide:
        print(json.dumps(decide_latency(args.reps or 30, args.seed), indent=1))
        return
    reps = args.reps or (3 if args.quick else 20)
    exact_reps = 1 if args.quick else min(reps, 5)
    methods = [m for m in args.methods.split(",") if m]
    for meth in methods:
        if meth not in METHODS:
            ap.error(f"unknown method {meth!r}; choose from {list(METHODS)}")
    sizes = [(n, m) for n in ns for m in ms]
    if args.quick:  # exact solvers take seconds from n = 1024: SCIP at the headline size only

        def exact_sizes(n: int, m: int, meth: str) -> bool:
            return n <= 256 or (n, m, meth) == (1024, 20, "scip")

    else:

        def exact_sizes(n: int, m: int, meth: str) -> bool:
            return n <= args.exact_max_n

    rows = run(sizes, methods, reps, args.seed, exact_sizes, exact_reps)  # type: ignore[arg-type]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
