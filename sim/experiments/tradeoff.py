"""``tradeoff`` (paper A, Lagrangian δ): utility vs SLO attainment of per-query SFS
(``latency-aware``) and batch ILP + SFS (``batch-ilp-sfs``) as δ varies, with the
baselines as points. Its traffic (Poisson, its own seed stream) is not the ``ontime``
experiment's, so a δ picked here is not tuned on the runs ``ontime`` reports."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sim import report
from sim.experiments.common import (
    BASELINES,
    DELTA_POLICIES,
    ONTIME_SLO,
    UTILITY_LAMBDA,
    CachedLength,
    ExperimentInputs,
    ExperimentResult,
    Progress,
    finish,
    make_policy,
    sim_eval_config,
    sim_setup,
    simulate,
    workload_for,
)
from sim.traffic import SloSpec, poisson_arrivals

TRADEOFF_DELTAS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
"""δ of ``latency-aware`` and ``batch-ilp-sfs``: score = U − δ·L̂/τ (utility given up per SLO
of estimated TTFT)."""


def run_tradeoff(inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    t0 = time.perf_counter()
    st = sim_setup(inputs)
    rate = 20.0
    duration = 40.0 if inputs.quick else 120.0
    deltas = TRADEOFF_DELTAS[::2] if inputs.quick else TRADEOFF_DELTAS
    rng = np.random.default_rng([inputs.seed, 77])
    arr = poisson_arrivals(rate, duration, rng)
    w = workload_for(
        st.data, arr, SloSpec.parse(ONTIME_SLO), rng, lengths_from=st.lengths, name="tradeoff"
    )
    cfg = sim_eval_config()
    length = CachedLength(st.predictor.length, w.texts, w.prompt_tokens)
    rows: list[dict[str, Any]] = []
    points: dict[str, tuple[list[float], list[float]]] = {}
    curves: dict[str, list[dict[str, Any]]] = {}
    keys = ("mean_utility", "ontime_utility", "slo_attainment", "ttft_p99_ms")
    for pol in DELTA_POLICIES:
        label = f"{pol} (δ sweep)"
        points[label] = ([], [])
        curves[pol] = []
        for d in deltas:
            res = simulate(
                make_policy(
                    pol,
                    st.cluster,
                    st.quality,
                    UTILITY_LAMBDA,
                    length=length,
                    profiles=st.profiles,
                    delta=d,
                ),
                st.cluster,
                w,
                cfg,
                inputs.seed,
                profiles=st.profiles,
            )
            s = res.summary()
            curves[pol].append({"delta": d, **{k: s[k] for k in keys}})
            points[label][0].append(s["slo_attainment"])
            points[label][1].append(s["mean_utility"])
            rows.append({"policy": f"{pol} δ={d:g}", **{k: s[k] for k in keys}})
            if progress:
                progress(
                    f"tradeoff {pol} δ={d:g}: utility {s['mean_utility']:.4f} "
                    f"SLO {s['slo_attainment']:.3f}"
                )
    base: dict[str, Any] = {}
    for pol in BASELINES:
        res = simulate(
            make_policy(
                pol, st.cluster, st.quality, UTILITY_LAMBDA, length=length, profiles=st.profiles
            ),
            st.cluster,
            w,
            cfg,
            inputs.seed,
            profiles=st.profiles,
        )
        s = res.summary()
        base[pol] = {
            "mean_utility": s["mean_utility"],
            "ontime_utility": s["ontime_utility"],
            "slo_attainment": s["slo_attainment"],
        }
        points[pol] = ([s["slo_attainment"]], [s["mean_utility"]])
        rows.append(
            {
                "policy": pol,
                **{
                    k: s[k]
                    for k in ("mean_utility", "ontime_utility", "slo_attainment", "ttft_p99_ms")
                },
            }
        )
        if progress:
            progress(
                f"tradeoff {pol}: utility {s['mean_utility']:.4f} SLO {s['slo_attainment']:.3f}"
            )
    out = {
        "rate_per_s": rate,
        "duration_s": duration,
        "slo": ONTIME_SLO,
        "utility_lambda": UTILITY_LAMBDA,
        "latency_aware": curves["latency-aware"],
        "batch_ilp_sfs": curves["batch-ilp-sfs"],
        # the δ of each policy with the highest OnTimeUtility on this traffic
        "best_delta": {
            pol: max(c, key=lambda r: r["ontime_utility"])["delta"] for pol, c in curves.items()
        },
        "baselines": base,
    }
    png = report.plot_scatter(
        points,
        inputs.png("tradeoff"),
        xlabel="SLO attainment",
        ylabel="mean utility (score − λ·cost)",
        title=f"Paper A's δ trade-off at {rate:g} queries/s",
        lines=tuple(f"{pol} (δ sweep)" for pol in DELTA_POLICIES),
    )
    cols = [
        ("policy", "policy"),
        ("mean_utility", "mean utility"),
        ("ontime_utility", "OnTimeUtility"),
        ("slo_attainment", "SLO attainment"),
        ("ttft_p99_ms", "TTFT p99 ms"),
    ]
    return finish("tradeoff", out, rows, cols, png, t0)
