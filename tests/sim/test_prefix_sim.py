"""Prefix caches in the simulator (issue 14): the engine's cache, the router's model of it,
and policies that use it, on multi-turn traffic whose turns extend earlier prompts."""

from __future__ import annotations

import numpy as np
import pytest

from routing.policies import RouterContext, make_router
from schemas import ClusterConfig
from sim.cluster import ClusterError, SimCluster
from sim.evaluator import EvalConfig, evaluate
from sim.traffic import SloSpec, Workload, build_workload, rows_by_prefix_root
from tests.routing.test_long_context import MODELS, FakeQuality


def replicas(cached_price: float | None = None) -> ClusterConfig:
    step = {"c0_ms": 5.0, "c1_ms_per_token": 0.02, "c2_ms_per_ctx_token": 1e-5,
            "c3_ms_per_attn_unit": 2e-7}  # fmt: skip
    models = [
        {"name": m, "input_usd_per_token": 1e-7, "output_usd_per_token": 2e-7, "step_time": step,
         "cached_input_usd_per_token": cached_price,
         "scheduler": {"max_num_batched_tokens": 2048, "kv_blocks": 6000}}
        for m in MODELS
    ]  # fmt: skip
    instances = [{"id": f"{m}-{k}", "model": m} for m in MODELS for k in range(3)]
    return ClusterConfig.model_validate({"models": models, "instances": instances})


def multi_turn(n_conv: int = 40, turns: int = 5, seed: int = 0) -> Workload:
    """Conversations whose turn t's prompt is turn t-1's plus ~1,000 new tokens."""
    rng = np.random.default_rng(seed)
    arrivals, prompts, hashes = [], [], []
    for c in range(n_conv):
        t = float(rng.uniform(0, 20))
        blocks: list[int] = []
        for _ in range(turns):
            blocks = blocks + rng.integers(1, 2**62, 2).tolist()
            arrivals.append(t)
            prompts.append(len(blocks) * 512 + int(rng.integers(0, 300)))
            hashes.append(np.array(blocks, dtype=np.uint64))
            t += float(rng.exponential(3.0))
        del c
    order = np.argsort(arrivals, kind="stable")
    hashes = [hashes[i] for i in order]
    return build_workload(
        np.asarray(arrivals)[order],
        np.tile(np.array([0.5, 0.7, 0.9]), (10, 1)),
        [f"conversation topic {i}" for i in range(10)],
        ["chat"] * 10,
        MODELS,
        np.full(10, 100),
        np.full((10, 3), np.nan),
        SloSpec.parse("fixed:1500"),
        rng,
        rows=rows_by_prefix_root(hashes, 10, rng),
        trace_input_tokens=np.asarray(prompts)[order],
        trace_output_tokens=rng.integers(20, 200, len(prompts)),
        name="mt",
        prefix_hashes=hashes,
        prefix_block_tokens=512,
    )


def run(name: str, prefix_aware: bool = True, view: str = "model") -> dict[str, float]:
    cfg = replicas()
    ctx = RouterContext.build(cfg, FakeQuality(), prefix_aware=prefix_aware)
    res = evaluate(
        make_router(name, ctx), SimCluster(cfg, seed=0, prefix_view=view),  # type: ignore[arg-type]
        multi_turn(), EvalConfig(window_s=0.2),
    )  # fmt: skip
    assert (res.decided == 1).all()
    return res.summary()


def test_prefix_aware_routing_finds_the_cache_and_lowers_ttft() -> None:
    aware = run("batch-ilp-sfs")
    blind = run("batch-ilp-sfs", prefix_aware=False)
    affinity = run("prefix-affinity")
    spread = run("shortest-queue")
    # turns share ~80% of their prompt with the previous one: what routing can recover
    assert aware["cache_hit_rate"] > blind["cache_hit_rate"] + 0.15
    assert aware["ttft_p50_ms"] < blind["ttft_p50_ms"]
    assert affinity["cache_hit_rate"] > spread["cache_hit_rate"]
    # quality-aware: the ILP keeps the best model; prefix affinity ignores quality
    assert aware["mean_quality"] > affinity["mean_quality"]


def test_realised_cost_bills_what_the_engine_found_cached_at_the_cached_price() -> None:
    cfg = replicas(cached_price=1e-8)
    ctx = RouterContext.build(cfg, FakeQuality(), prefix_aware=True)
    w = multi_turn()
    res = evaluate(make_router("batch-ilp-sfs", ctx), SimCluster(cfg, seed=0), w,  # type: ignore[arg-type]
                   EvalConfig(window_s=0.2))  # fmt: skip
    served = np.flatnonzero(res.served)
    assert res.cached_tokens[served].sum() > 0.3 * res.prompt_tokens[served].sum()
    out = w.output_tokens[served, res.model[served]]
    want = 1e-7 * res.prompt_tokens[served] - 9e-8 * res.cached_tokens[served] + 2e-7 * out
    np.testing.assert_allclose(res.cost_usd[served], want, rtol=1e-9)


def test_rows_of_one_conversation_share_their_text() -> None:
    w = multi_turn(n_conv=5, turns=3)
    assert w.prefix_hashes is not None
    roots = [int(h[0]) for h in w.prefix_hashes]
    for r in set(roots):
        assert len({int(w.row[i]) for i in range(w.n) if roots[i] == r}) == 1
    q = w.query(0)
    assert q.prefix_hashes == w.prefix_hashes[0].tolist() and q.prefix_block_tokens == 512


def test_router_model_tracks_the_engine_and_unknown_views_are_refused() -> None:
    cfg = replicas()
    cluster = SimCluster(cfg, seed=0)
    cluster.submit("a", "small-0", 0.0, 3000, 5, prefix_hashes=[1, 2, 3, 4, 5, 6])
    # routed: the model holds the whole blocks at once (they will be cached as it prefills)
    assert cluster.views()[0].prefix_hashes is not None
    assert cluster.views()[0].prefix_hashes.tolist() == [1, 2, 3, 4, 5]
    cluster.drain()
    assert cluster.engines["small-0"].cached_hashes().tolist() == [1, 2, 3, 4, 5]
    assert cluster.prefix_hit_rate()["small-0"] == 0.0
    with pytest.raises(ClusterError, match="prefix_view must be"):
        SimCluster(cfg, prefix_view="oracle")  # type: ignore[arg-type]
