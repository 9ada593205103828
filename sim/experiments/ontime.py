"""``ontime`` (paper A, "Metric: OnTimeUtility"): OnTimeUtility vs arrival rate in the
simulator for round-robin, shortest-queue, latency-agnostic, per-query SFS and batch ILP +
SFS, under Poisson and MMPP arrivals, over a rate grid from under- to over-load of the
cluster, several traffic seeds (mean ± standard deviation); AUC over rates (trapezoid) and
each policy's AUC gain over the best baseline (paper A: +33%).

The quality predictor is trained once (the 70/30 split of ``inputs.seed``); each seed
draws its own arrivals, request sizes and SLOs and runs the simulated engines with its own
step-time noise. ``inputs.delta`` is paper A's δ for both latency-aware policies
(``latency-aware`` and ``batch-ilp-sfs``), so they are compared at the same δ.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sim import report
from sim.experiments.common import (
    BASELINES,
    DELTA_POLICIES,
    ONTIME_POLICIES,
    ONTIME_SLO,
    UTILITY_LAMBDA,
    CachedLength,
    ExperimentError,
    ExperimentInputs,
    ExperimentResult,
    FloatArray,
    OracleQuality,
    Progress,
    SimSetup,
    finish,
    make_policy,
    sim_eval_config,
    sim_setup,
    simulate,
    workload_for,
)
from sim.traffic import MMPPSpec, SloSpec, Workload, mmpp_arrivals, poisson_arrivals

RATES_PER_S = (4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0)
"""Under- to over-load of the paper-A clusters (160 slots): at 4/s nothing queues, from
~20/s on the slots and prefill capacity saturate and queues grow for the whole run."""
QUICK_RATES_PER_S = (8.0, 16.0, 24.0)
SEEDS = 3
"""Traffic seeds of a full run (``inputs.seed`` and the next ones); 2 in a quick run."""
PROCESSES = ("poisson", "mmpp")
ORACLE = "batch-ilp-sfs, oracle quality"
"""A reference curve: batch-ilp-sfs routing on the realised scores instead of predictions
(``OracleQuality``), to show how much of the gap to paper A the predictor leaves."""
CURVES = (*ONTIME_POLICIES, ORACLE)
KEYS = (
    "ontime_utility",
    "slo_attainment",
    "mean_quality",
    "spend_usd",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "decide_p50_ms",
    "decide_p99_ms",
)


def _auc(x: FloatArray, y: FloatArray) -> float:
    return float(np.trapezoid(y, x))


def ontime_workload(
    st: SimSetup, process: str, rate: float, duration_s: float, seed: int
) -> Workload:
    """The traffic of one point: Poisson, or MMPP with bursts at 3× the calm rate for 20%
    of the time (mean burst 10 s), at mean ``rate`` per second."""
    rng = np.random.default_rng([seed, int(rate * 100), process == "mmpp"])
    if process == "poisson":
        arr = poisson_arrivals(rate, duration_s, rng)
    else:
        spec = MMPPSpec.bursty(rate, burst_ratio=3.0, burst_share=0.2, mean_burst_s=10.0)
        arr, _ = mmpp_arrivals(spec, duration_s, rng)
    slo = SloSpec.parse(ONTIME_SLO)
    return workload_for(
        st.data, arr, slo, rng, lengths_from=st.lengths, name=f"{process}{rate:g}s{seed}"
    )


def _mean_sd(a: FloatArray) -> str:
    return f"{float(np.mean(a)):.4g} ± {float(np.std(a, ddof=1)) if a.size > 1 else 0.0:.2g}"


def run_ontime(inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    t0 = time.perf_counter()
    if inputs.seeds is not None and inputs.seeds < 1:
        raise ExperimentError(f"seeds must be >= 1, got {inputs.seeds}")
    st = sim_setup(inputs)
    rates = np.asarray(QUICK_RATES_PER_S if inputs.quick else RATES_PER_S)
    duration = 40.0 if inputs.quick else 120.0
    seeds = [inputs.seed + s for s in range(inputs.seeds or (2 if inputs.quick else SEEDS))]
    cfg = sim_eval_config()
    oracle = OracleQuality(st.data)
    knobs: dict[str, Any] = {} if inputs.delta is None else {"delta": inputs.delta}
    # [process][policy] -> [seed, rate] arrays of each summary key
    runs = {
        p: {pol: {k: np.zeros((len(seeds), rates.size)) for k in KEYS} for pol in CURVES}
        for p in PROCESSES
    }
    for s, seed in enumerate(seeds):
        for process in PROCESSES:
            for r, rate in enumerate(rates.tolist()):
                w = ontime_workload(st, process, rate, duration, seed)
                length = CachedLength(st.predictor.length, w.texts, w.prompt_tokens)
                for pol in CURVES:
                    router = make_policy(
                        "batch-ilp-sfs" if pol == ORACLE else pol,
                        st.cluster,
                        oracle if pol == ORACLE else st.quality,
                        UTILITY_LAMBDA,
                        length=length,
                        profiles=st.profiles,
                        **(knobs if pol in (*DELTA_POLICIES, ORACLE) else {}),
                    )
                    res = simulate(router, st.cluster, w, cfg, seed, profiles=st.profiles)
                    summ = res.summary()
                    for k in KEYS:
                        runs[process][pol][k][s, r] = summ[k]
                    if progress:
                        progress(
                            f"ontime seed {seed} {process} {rate:g}/s {pol}: OnTimeUtility "
                            f"{summ['ontime_utility']:.4f} SLO {summ['slo_attainment']:.3f} "
                            f"({res.sim_wall_s:.1f}s)"
                        )
    out, rows = _summarise(runs, rates, seeds)
    out.update(
        {
            "delta": inputs.delta,
            "delta_policies": list(DELTA_POLICIES),
            "seeds": seeds,
            "rates_per_s": rates.tolist(),
            "duration_s": duration,
            "slo": ONTIME_SLO,
            "utility_lambda": UTILITY_LAMBDA,
        }
    )
    png = report.plot_panels(
        {
            f"{proc} arrivals": (
                rates.tolist(),
                {p: runs[proc][p]["ontime_utility"].mean(axis=0).tolist() for p in CURVES},
            )
            for proc in PROCESSES
        },
        inputs.png("ontime"),
        xlabel="arrival rate (queries/s)",
        ylabel=f"OnTimeUtility (mean ± sd over {len(seeds)} seeds)",
        highlight=DELTA_POLICIES,
        bands={
            f"{proc} arrivals": {p: _sd(runs[proc][p]["ontime_utility"]).tolist() for p in CURVES}
            for proc in PROCESSES
        },
    )
    cols = [
        ("process", "arrivals"),
        ("policy", "policy"),
        ("auc", "AUC"),
        ("gain", "vs best baseline"),
    ]
    cols += [(f"r{r:g}", f"{r:g}/s") for r in rates.tolist()]
    notes = [_ilp_vs_la_note(out, rates)]
    return finish("ontime", out, rows, cols, png, t0, notes=notes)


def _sd(a: FloatArray) -> FloatArray:
    out: FloatArray = a.std(axis=0, ddof=1) if a.shape[0] > 1 else np.zeros(a.shape[1])
    return out


def _summarise(
    runs: dict[str, dict[str, dict[str, FloatArray]]], rates: FloatArray, seeds: list[int]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per process: each policy's AUC per seed, its gain over the best baseline (the
    baseline with the highest mean AUC) per seed, mean ± sd; and both processes together."""
    out: dict[str, Any] = {"policies": {}}
    rows: list[dict[str, Any]] = []
    total = {p: np.zeros(len(seeds)) for p in CURVES}
    for process in PROCESSES:
        ou = {p: runs[process][p]["ontime_utility"] for p in CURVES}
        auc = {p: np.array([_auc(rates, ou[p][s]) for s in range(len(seeds))]) for p in ou}
        best = max(BASELINES, key=lambda b: float(auc[b].mean()))
        out[process] = {"best_baseline": best}
        for p in CURVES:
            total[p] += auc[p]
            gain = auc[p] / auc[best] - 1
            out[process][p] = {
                "auc": float(auc[p].mean()),
                "auc_sd": float(np.std(auc[p], ddof=1)) if len(seeds) > 1 else 0.0,
                "auc_per_seed": auc[p].tolist(),
                "auc_gain_vs_best_baseline": float(gain.mean()),
                "auc_gain_sd": float(np.std(gain, ddof=1)) if len(seeds) > 1 else 0.0,
                "ontime_utility": ou[p].mean(axis=0).tolist(),
                "ontime_utility_sd": _sd(ou[p]).tolist(),
                "runs": {k: runs[process][p][k].tolist() for k in KEYS},
            }
            rows.append(
                {
                    "process": process,
                    "policy": p,
                    "auc": _mean_sd(auc[p]),
                    "gain": f"{gain.mean() * 100:+.1f}% ± {out[process][p]['auc_gain_sd'] * 100:.1f}",
                    **{f"r{r:g}": _mean_sd(ou[p][:, i]) for i, r in enumerate(rates.tolist())},
                }
            )
        ilp, la = ou["batch-ilp-sfs"], ou["latency-aware"]
        out[process]["batch_ilp_minus_latency_aware"] = {
            "mean": (ilp - la).mean(axis=0).tolist(),
            "sd": _sd(ilp - la).tolist(),
            "ilp_ahead_every_seed": (ilp >= la).all(axis=0).tolist(),
        }
    best = max(BASELINES, key=lambda b: float(total[b].mean()))
    out["policies"]["best_baseline"] = best
    for p in CURVES:
        gain = total[p] / total[best] - 1
        out["policies"][p] = {
            "auc": float(total[p].mean()),
            "auc_gain_vs_best_baseline": float(gain.mean()),
            "auc_gain_sd": float(np.std(gain, ddof=1)) if len(seeds) > 1 else 0.0,
        }
    return out, rows


def _ilp_vs_la_note(out: dict[str, Any], rates: FloatArray) -> str:
    lines = [
        "batch-ilp-sfs − latency-aware, OnTimeUtility per rate (mean ± sd over seeds; "
        "* = batch-ilp-sfs ≥ latency-aware on every seed):",
        "",
    ]
    for process in PROCESSES:
        d = out[process]["batch_ilp_minus_latency_aware"]
        cells = [
            f"{r:g}/s {m:+.4f} ± {s:.4f}{'*' if ok else ''}"
            for r, m, s, ok in zip(
                rates.tolist(), d["mean"], d["sd"], d["ilp_ahead_every_seed"], strict=True
            )
        ]
        lines.append(f"- {process}: " + "; ".join(cells))
    return "\n".join(lines)
