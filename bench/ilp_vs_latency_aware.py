"""batch-ilp-sfs vs latency-aware at the same δ, with and without the learnt TTFT margin
(issue 13, item 3): a quick check on the paper-A tiers of the 20-model pool.

    .venv/bin/python bench/ilp_vs_latency_aware.py [--delta 1.0] [--duration 40] [--seed 0]

One predictor (GBDT, the 70/30 split of the experiments, seed 0); the TTFT margin is the
0.9 quantile of observed/predicted TTFT of one batch-ilp-sfs run (Poisson 16/s) on seed
1000, which no evaluated run uses; then OnTimeUtility at 4, 12, 20 and 28 queries/s
(under- to over-load: the tiers' slots serve ~22/s), Poisson and MMPP, one seed. Needs
``../shared`` (the 20-model pool). Prints one JSON line per point. The full figure with
three seeds is ``switchyard experiment ontime``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.profiles import read_profiles  # noqa: E402
from offline.blas import limit_blas_threads  # noqa: E402
from offline.datasets import load_routing_data  # noqa: E402
from sim.evaluator import EvalConfig  # noqa: E402
from sim.experiments import (  # noqa: E402
    ONTIME_SLO,
    UTILITY_LAMBDA,
    CachedLength,
    ExperimentInputs,
    make_policy,
    sim_setup,
    simulate,
    workload_for,
)
from sim.traffic import MMPPSpec, SloSpec, mmpp_arrivals, poisson_arrivals  # noqa: E402
from sim.ttft_calibration import RecordingRouter, margin_from_run  # noqa: E402
from wiring.paths import shared_data, vendored_data  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delta", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    limit_blas_threads(1)
    inputs = ExperimentInputs(
        data_path=shared_data("routing", "irt_router_ccf20", "scores.csv.gz"),
        data_format="irt-wide",
        models_csv=None,
        cluster_path=ROOT / "configs" / "clusters" / "paper_a_ccf20.yaml",
        out_dir=Path("."),
        trace_path=vendored_data("profiles", "traces", "azure_llm_2023_conv_first4000.csv.gz"),
        quick=True,
        seed=0,
        loader=load_routing_data,
        profiles=read_profiles(),
    )
    st = sim_setup(inputs)
    cfg = EvalConfig(window_s=0.05, max_batch=64, utility_lambda=UTILITY_LAMBDA)
    slo = SloSpec.parse(ONTIME_SLO)

    def wl(process: str, rate: float, seed: int):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng([seed, int(rate * 100), process == "mmpp"])
        if process == "poisson":
            arr = poisson_arrivals(rate, args.duration, rng)
        else:
            spec = MMPPSpec.bursty(rate, burst_ratio=3.0, burst_share=0.2, mean_burst_s=10.0)
            arr = mmpp_arrivals(spec, args.duration, rng)[0]
        return workload_for(
            st.data, arr, slo, rng, lengths_from=st.lengths, name=f"{process}{rate:g}s{seed}"
        )

    delta = args.delta
    w = wl("poisson", 16.0, 1000)
    L = CachedLength(st.predictor.length, w.texts, w.prompt_tokens)
    rec = RecordingRouter(
        make_policy(
            "batch-ilp-sfs",
            st.cluster,
            st.quality,
            UTILITY_LAMBDA,
            length=L,
            profiles=st.profiles,
            delta=delta,
        )
    )
    res = simulate(rec, st.cluster, w, cfg, 1000, profiles=st.profiles)
    m = margin_from_run(rec, res, w, 0.9)
    pr, ob = rec.pairs(res, w)
    ok = np.isfinite(pr) & np.isfinite(ob) & (pr > 1)
    print(
        json.dumps(
            {"margin": m, "pairs": int(ok.sum()), "median_ratio": float(np.median(ob[ok] / pr[ok]))}
        )
    )
    pols = {
        "latency-agnostic": ("latency-agnostic", {}),
        "latency-aware": ("latency-aware", {"delta": delta}),
        "batch-ilp-sfs": ("batch-ilp-sfs", {"delta": delta}),
        "batch-ilp-sfs+margin": ("batch-ilp-sfs", {"delta": delta, "ttft_margin": m}),
    }
    for process in ("poisson", "mmpp"):
        for rate in (4.0, 12.0, 20.0, 28.0):
            w = wl(process, rate, args.seed)
            L = CachedLength(st.predictor.length, w.texts, w.prompt_tokens)
            row: dict[str, object] = {"process": process, "rate_per_s": rate}
            for name, (pol, kn) in pols.items():
                router = make_policy(
                    pol,
                    st.cluster,
                    st.quality,
                    UTILITY_LAMBDA,
                    length=L,
                    profiles=st.profiles,
                    **kn,
                )
                row[name] = simulate(
                    router, st.cluster, w, cfg, args.seed, profiles=st.profiles
                ).summary()["ontime_utility"]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
