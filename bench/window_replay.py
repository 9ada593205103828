"""Capture the windows a ``bench/service.py --core`` run hands ``Router.decide``, then replay
them through a fresh router of this tree: the same windows for two trees, a profile, counts.

    .venv/bin/python bench/window_replay.py capture W.pkl --core --policy batch-ilp-sfs \
        --max-batch 1000 --fresh-views          # bench/service.py's arguments after the file
    .venv/bin/python bench/window_replay.py replay W.pkl --reps 5 --stats --digest
    .venv/bin/python bench/window_replay.py replay W.pkl --profile

``replay`` builds the router as the capture did (policy, cluster, predictor artefact; or
``--predictor``), decides the first window as the bench's warm-up, then the others, ``--reps``
times, and prints CPU µs/query of ``Router.decide`` and of the ILP with its TTFT cuts
(``ttft_ilp``, as the bench's split); ``--stats``: solves, L-BFGS evaluations and in-order
SFS runs of the timed windows; ``--digest``: a hash of every decision but its ``decide_ms``
(the same in two trees: the same decisions); ``--profile``: cProfile of one pass.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pickle
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def capture(out: Path, bench_args: list[str]) -> int:
    import service  # bench/service.py

    import streams.policy

    windows: list[bytes] = []
    made: list[bytes] = []
    load = streams.policy.load_router

    def load_router(*a: Any, **kw: Any) -> Any:
        router = load(*a, **kw)
        made.append(pickle.dumps((a, kw)))
        decide = router.decide

        def captured(queries: Any, instances: Any, budget: Any, now: float) -> Any:
            windows.append(pickle.dumps((list(queries), list(instances), budget, now)))
            return decide(queries, instances, budget, now)

        router.decide = captured
        return router

    streams.policy.load_router = load_router  # type: ignore[assignment]
    sys.argv = ["service.py", *bench_args]
    rc = service.main()
    out.write_bytes(pickle.dumps({"router": made[0], "windows": windows}))
    print(f"captured {len(windows)} windows", file=sys.stderr)
    return int(rc)


def replay(args: argparse.Namespace) -> int:
    from offline.blas import limit_blas_threads

    limit_blas_threads(1)  # as `switchyard router` and the bench
    import routing.ilp.ttft_cuts as ttft_cuts
    import routing.policies.batch_ilp as batch_ilp
    import streams.policy

    saved = pickle.loads(args.windows.read_bytes())
    a, kw = pickle.loads(saved["router"])
    if args.predictor:
        a = (a[0], a[1], str(args.predictor), *a[3:])
    windows = [pickle.loads(w) for w in saved["windows"]]
    n = sum(len(w[0]) for w in windows[1:])
    ilp_s = [0.0]
    counts = {"solves": 0, "evaluations": 0, "in_order_runs": 0}
    cuts = batch_ilp.solve_with_ttft_cuts

    def timed_cuts(*x: Any, **y: Any) -> Any:
        t0 = time.process_time()
        try:
            return cuts(*x, **y)
        finally:
            ilp_s[0] += time.process_time() - t0

    batch_ilp.solve_with_ttft_cuts = timed_cuts  # type: ignore[assignment]
    solve = batch_ilp.solve

    def counted_solve(*x: Any, **y: Any) -> Any:
        sol = solve(*x, **y)
        counts["solves"] += 1
        counts["evaluations"] += sol.iterations
        return sol

    batch_ilp.solve = counted_solve  # type: ignore[assignment]
    checks_init = ttft_cuts._Checks.__init__

    def counted_checks(self: Any, run: Any) -> None:
        def counted(*x: Any) -> Any:
            counts["in_order_runs"] += 1
            return run(*x)

        checks_init(self, counted)

    ttft_cuts._Checks.__init__ = counted_checks  # type: ignore[method-assign]

    def one_pass(prof: cProfile.Profile | None = None) -> tuple[float, list[Any]]:
        router = streams.policy.load_router(*a, **kw)
        router.decide(*windows[0])  # the bench's warm-up window
        ilp_s[0] = 0.0
        for key in counts:
            counts[key] = 0
        outs = []
        t0 = time.process_time()
        if prof is not None:
            prof.enable()
        for w in windows[1:]:
            outs.append(router.decide(*w))
        if prof is not None:
            prof.disable()
        return time.process_time() - t0, outs

    decide_us, ilp_us = [], []
    outs: list[Any] = []
    for _ in range(args.reps):
        cpu_s, outs = one_pass()
        decide_us.append(round(cpu_s / n * 1e6, 2))
        ilp_us.append(round(ilp_s[0] / n * 1e6, 2))
    report: dict[str, object] = {
        "windows": len(windows) - 1,
        "decide_us_per_query": decide_us,
        "ttft_ilp_us_per_query": ilp_us,
        "ttft_ilp_median": statistics.median(ilp_us) if ilp_us else None,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if args.stats:
        report |= {f"{k}_per_window": round(v / (len(windows) - 1), 2) for k, v in counts.items()}
    if args.digest:
        h = hashlib.sha256()
        for window in outs:
            for d in window:
                j = d.model_dump(mode="json")
                j.pop("decide_ms", None)
                (j.get("window") or {}).pop("decide_ms", None)
                h.update(json.dumps(j, sort_keys=True, default=str).encode())
        report["digest"] = h.hexdigest()[:16]
    print(json.dumps(report))
    if args.profile:
        prof = cProfile.Profile()
        one_pass(prof)
        pstats.Stats(prof).sort_stats(args.sort).print_stats(40)
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "capture":
        return capture(Path(sys.argv[2]), sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["replay"])
    ap.add_argument("windows", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--predictor", type=Path, help="another quality predictor artefact")
    ap.add_argument("--stats", action="store_true")
    ap.add_argument("--digest", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sort", default="cumulative", help="--profile: pstats sort key")
    return replay(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
