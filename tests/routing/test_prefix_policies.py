"""Policies with prefix-cache hits (issue 14): prefix affinity follows the cache and then the
load; batch-ilp-sfs prefers the replica holding a query's prefix and places a window's
prefix-sharing queries together; prefix-agnostic contexts see no hits at all."""

from __future__ import annotations

import numpy as np
import pytest

from routing.policies import RouterContext, make_router
from routing.types import Budget, InstanceState, InstanceView
from schemas import ClusterConfig, DecisionStatus, Query
from tests.routing.test_long_context import FakeQuality

STEP = {"c0_ms": 5.0, "c1_ms_per_token": 0.02, "c2_ms_per_ctx_token": 1e-5,
        "c3_ms_per_attn_unit": 2e-7}  # fmt: skip


def replicas(n: int = 3) -> ClusterConfig:
    models = [
        {"name": m, "input_usd_per_token": 1e-7, "output_usd_per_token": 2e-7, "step_time": STEP,
         "scheduler": {"max_num_batched_tokens": 2048, "kv_blocks": 20_000}}
        for m in ("small", "mid", "large")
    ]  # fmt: skip
    instances = [{"id": f"large-{k}", "model": "large"} for k in range(n)]
    instances += [{"id": "small-0", "model": "small"}, {"id": "mid-0", "model": "mid"}]
    return ClusterConfig.model_validate({"models": models, "instances": instances})


def views(cfg: ClusterConfig, cached: dict[str, list[int]], residents: dict[str, int]) -> list[InstanceView]:
    out = []
    for inst in cfg.instances:
        r = residents.get(inst.id, 0)
        z = np.zeros(r, dtype=np.int64)
        state = InstanceState(z + 2000, z + 2000, z + 3, z + 100)
        hashes = np.sort(np.asarray(cached.get(inst.id, []), dtype=np.uint64))
        out.append(InstanceView(inst.id, inst.model, state, free_slots=32, prefix_hashes=hashes))
    return out


def query(qid: str, hashes: list[int], tokens: int = 8192) -> Query:
    return Query(id=qid, prompt="talk", prompt_tokens=tokens, prefix_hashes=hashes,
                 prefix_block_tokens=512, ttft_slo_ms=5000.0)  # fmt: skip


def decide(name: str, qs: list[Query], vs: list[InstanceView], aware: bool = True) -> list[str]:
    ctx = RouterContext.build(replicas(), FakeQuality(), prefix_aware=aware)
    ds = make_router(name, ctx).decide(qs, vs, Budget(window_usd=1e6), now=0.0)
    assert all(d.status == DecisionStatus.ROUTED for d in ds)
    return [str(d.instance_id) for d in ds]


def test_prefix_affinity_follows_the_cache_then_the_load() -> None:
    cfg = replicas()
    conv = list(range(1, 15))  # 14 blocks = 7,168 of the 8,192 tokens
    vs = views(cfg, {"large-2": conv}, {"large-0": 1, "large-1": 2, "large-2": 6, "small-0": 4})
    got = decide("prefix-affinity", [query("a", conv + [99, 100])], vs)
    assert got == ["large-2"]  # 3 · 0.875 beats the queue score on the busiest instance
    # no cache anywhere: the least loaded
    assert decide("prefix-affinity", [query("b", [500, 501])], vs) == ["mid-0"]
    # the window's own routing warms its index: the second turn follows the first
    first, second = decide("prefix-affinity", [query("c", [7, 8]), query("d", [7, 8, 9])], vs)
    assert first == second
    with pytest.raises(ValueError, match="w_queue must be a finite number >= 0"):
        make_router("prefix-affinity", RouterContext.build(cfg, FakeQuality()), w_queue=-1.0)


def test_batch_ilp_sfs_prefers_the_replica_with_the_prefix_unless_blind() -> None:
    cfg = replicas()
    conv = list(range(1, 31))  # 15,360 cached tokens of a 16k prompt
    vs = views(cfg, {"large-1": conv}, {"large-1": 2})
    q = query("a", conv + [77], tokens=16_000)
    assert decide("batch-ilp-sfs", [q], vs) == ["large-1"]
    # prefix-agnostic: the same quality everywhere, so the least loaded replica
    assert decide("batch-ilp-sfs", [q], vs, aware=False) != ["large-1"]


def test_batch_ilp_sfs_puts_a_windows_prefix_sharing_queries_together() -> None:
    """Two turns of one conversation in one window, nothing cached yet, a 500 ms SLO: one
    cold 14.5k-token prefill takes ~320 ms, so the second behind it misses its SLO unless it
    finds the first's prefill cached. Prefix-aware, the re-check sees that and keeps them
    together; blind, the re-check cuts the pair and spreads them."""
    cfg = replicas()
    vs = views(cfg, {}, {})
    shared = list(range(200, 228))
    qs = [query("t1", shared, tokens=14_500), query("t2", shared + [900, 901], tokens=15_500)]
    qs = [q.model_copy(update={"ttft_slo_ms": 500.0}) for q in qs]
    a, b = decide("batch-ilp-sfs", qs, vs)
    assert a == b
    a2, b2 = decide("batch-ilp-sfs", qs, vs, aware=False)
    assert a2 != b2


def test_a_cached_prefix_is_billed_at_the_cached_input_price_and_can_keep_its_model() -> None:
    """mid (quality bound 0.6, cheap) beats large (0.8, 2e-6 USD a token) on a cold 16k-token
    prompt at λ = 10 per USD (0.584 vs 0.48); with 15,360 of its tokens cached on large at a
    tenth of the price, large wins (0.757): the follow-up stays where its prefix is."""

    def cfg(cached_price: float | None) -> ClusterConfig:
        big = {"name": "large", "input_usd_per_token": 2e-6, "output_usd_per_token": 0.0,
               "cached_input_usd_per_token": cached_price, "step_time": STEP,
               "scheduler": {"max_num_batched_tokens": 2048, "kv_blocks": 20_000}}  # fmt: skip
        mid = {**big, "name": "mid", "input_usd_per_token": 1e-7, "cached_input_usd_per_token": None}
        small = {**mid, "name": "small"}
        return ClusterConfig.model_validate(
            {"models": [small, mid, big],
             "instances": [{"id": "large-0", "model": "large"}, {"id": "mid-0", "model": "mid"}]}
        )  # fmt: skip

    conv = list(range(1, 31))  # 30 blocks of 512: 15,360 tokens cached on large-0
    q = query("a", conv + [77], tokens=16_000)

    def route(cached_price: float | None, aware: bool = True) -> tuple[str, float]:
        c = cfg(cached_price)
        ctx = RouterContext.build(c, FakeQuality(), lam_per_usd=10.0, prefix_aware=aware)
        (d,) = make_router("batch-ilp-sfs", ctx).decide([q], views(c, {"large-0": conv}, {}),
                                                       Budget(window_usd=1e6), now=0.0)  # fmt: skip
        assert d.predicted_cost_usd is not None
        return str(d.instance_id), d.predicted_cost_usd

    inst, cost = route(2e-7)
    assert inst == "large-0" and cost == pytest.approx(2e-6 * 640 + 2e-7 * 15_360)
    assert route(None)[0] == "mid-0"  # no discount: the cache does not pay for large's price
    assert route(2e-7, aware=False)[0] == "mid-0"  # blind to the cache
    with pytest.raises(ValueError, match="cached_input_usd_per_token .* must be <= input"):
        cfg(3e-6)
