"""Benchmark of the window ILP solvers (issue 5, item 7).

    .venv/bin/python bench/ilp.py --quick        # < 60 s, JSON list on stdout
    .venv/bin/python bench/ilp.py                # the full table of docs/benchmarks/ilp.md

Instances: n queries × m models with model abilities and query difficulties
(quality in [0, 1]), prices spread over two orders of magnitude and correlated with
ability, a binding budget (30% of the way from the cheapest to the max-quality
assignment's cost), binding capacities (the best models hold few queries) and ~10%
infeasible pairs. Each row: {n, m, method, ms_p50, ms_p99, gap} where gap is the
relative gap of the method's objective to the best proven upper bound of any method
on the same instance (≤ certified gap), ms is wall time including model building.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
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


def run(
    sizes: list[tuple[int, int]], methods: list[Method], reps: int, seed: int, scip_max_n: int
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for n, m in sizes:
        times: dict[str, list[float]] = {meth: [] for meth in methods}
        objs: dict[str, list[float]] = {meth: [] for meth in methods}
        bounds: list[float] = []
        for r in range(reps):
            prob = make_instance(n, m, seed + 1000 * r + n + m)
            best_bound = math.inf
            for meth in methods:
                if meth in ("scip", "highs") and n > scip_max_n:
                    continue
                t0 = time.perf_counter()
                sol = solve(prob, meth, gap_tol=1e-3 if meth.startswith("fast") else 1e-9)
                times[meth].append((time.perf_counter() - t0) * 1e3)
                assert not prob.violations(sol.assignment), (meth, prob.violations(sol.assignment))
                objs[meth].append(sol.objective)
                best_bound = min(best_bound, sol.bound)
            bounds.append(best_bound)
        for meth in methods:
            if not times[meth]:
                continue
            gaps = [relative_gap(o, b) for o, b in zip(objs[meth], bounds, strict=True)]
            rows.append(
                {
                    "n": n,
                    "m": m,
                    "method": meth,
                    "ms_p50": round(float(np.percentile(times[meth], 50)), 3),
                    "ms_p99": round(float(np.percentile(times[meth], 99)), 3),
                    "gap": float(f"{max(gaps):.3g}"),
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
    args = ap.parse_args()
    ns = [64, 256, 1024, 4096]
    ms = [11, 20]
    reps = args.reps or (3 if args.quick else 20)
    methods = [m for m in args.methods.split(",") if m]
    for meth in methods:
        if meth not in METHODS:
            ap.error(f"unknown method {meth!r}; choose from {list(METHODS)}")
    sizes = [(n, m) for n in ns for m in ms]
    rows = run(sizes, methods, reps, args.seed, scip_max_n=1024 if args.quick else 4096)  # type: ignore[arg-type]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
