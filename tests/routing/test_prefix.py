"""Prefix identity and hits (issue 14): derived block hashes, leading-run hits, sharing within
a window, the router's LRU model, and SFS with hits equal to the engine's prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from routing.prefix import (
    LruPrefixModel,
    WindowPrefixes,
    full_blocks,
    query_block_hashes,
    routed_hit_tokens,
)
from routing.sfs import estimate_ttft_ms, standalone_ttft_ms
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import Query, SchedulerConfig
from schemas.prefix import TEXT_BLOCK_BYTES, text_block_hashes
from sim.engine import SimEngine
from sim.timing import LinearTiming

M = StepTimeModel(5.0, 0.02, 1e-4, 1e-6)


def test_derived_hashes_are_chained_deterministic_and_whole_blocks_only() -> None:
    a = "a" * (3 * TEXT_BLOCK_BYTES + 10)
    b = a[: 2 * TEXT_BLOCK_BYTES] + "b" * (2 * TEXT_BLOCK_BYTES)
    ha, hb = text_block_hashes(a), text_block_hashes(b)
    assert len(ha) == 3 and len(hb) == 4  # the 10-byte tail is no block
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert text_block_hashes(a) == ha  # same text, same hashes, in any process
    # the same block content at another position is another hash (the chain)
    assert len(set(text_block_hashes("a" * 4 * TEXT_BLOCK_BYTES))) == 4
    assert text_block_hashes("short") == []
    # chat: turn 2 starts with turn 1's text, so it extends turn 1's chain
    turn1 = [{"role": "user", "content": "x" * 3000}]
    turn2 = turn1 + [{"role": "assistant", "content": "y" * 900}, {"role": "user", "content": "z"}]
    h1, _ = Query(id="t1", messages=turn1).prefix_blocks()
    h2, _ = Query(id="t2", messages=turn2).prefix_blocks()
    assert len(h1) == 2 and h2[:2] == h1


def test_a_query_carries_its_own_hashes_or_gets_derived_ones() -> None:
    q = Query(id="m", prompt="p", prompt_tokens=2000, prefix_hashes=[7, 8, 9], prefix_block_tokens=512)
    h, bt = query_block_hashes(q)
    assert h.tolist() == [7, 8, 9] and bt == 512.0
    text = "x" * 8 * TEXT_BLOCK_BYTES
    h2, bt2 = query_block_hashes(Query(id="d", prompt=text))
    assert h2.size == 8 and bt2 == TEXT_BLOCK_BYTES / 4
    # the producer's token count rescales what a text block stands for
    _, bt3 = query_block_hashes(Query(id="e", prompt=text, prompt_tokens=1000))
    assert bt3 == pytest.approx(1000 / 8)
    with pytest.raises(ValueError, match="less than 18446744073709551616"):
        Query(id="bad", prompt="p", prefix_hashes=[2**64])


def test_hits_are_leading_runs_capped_one_token_short() -> None:
    blocks = [
        (np.array([1, 2, 3, 4], dtype=np.uint64), 100.0),
        (np.array([1, 2, 9], dtype=np.uint64), 100.0),
        (np.array([5], dtype=np.uint64), 100.0),
        (np.zeros(0, dtype=np.uint64), 100.0),
        (np.array([1, 2, 3], dtype=np.uint64), 100.0),
    ]
    wp = WindowPrefixes.build(blocks, np.array([400, 300, 100, 50, 250]))
    cached = np.array([1, 2, 3, 5], dtype=np.uint64)  # 4 is missing
    assert wp.leading_blocks(cached).tolist() == [3, 2, 1, 0, 3]
    # a prompt of 100 tokens in one cached block still prefills its last token
    assert wp.hit_tokens(cached).tolist() == [300, 200, 99, 0, 249]
    assert wp.hit_tokens(np.zeros(0, dtype=np.uint64)).tolist() == [0] * 5
    parent, shared = wp.sharing()
    # row 1 shares 2 blocks with row 0; row 4 shares 3 with row 0 (its own 3 blocks)
    assert parent.tolist() == [-1, 0, -1, -1, 0]
    assert shared.tolist() == [0, 200, 0, 0, 249]
    assert full_blocks(4, 399, 100.0) == 3 and full_blocks(2, 1000, 100.0) == 2


def test_routed_hits_count_the_snapshot_and_earlier_window_mates_on_the_same_instance() -> None:
    def q(i: int, hashes: list[int]) -> Query:
        return Query(id=f"q{i}", prompt="p", prompt_tokens=1000, prefix_hashes=hashes,
                     prefix_block_tokens=100)  # fmt: skip

    queries = [q(0, [1, 2, 3]), q(1, [1, 2, 3, 4, 5]), q(2, [1, 2, 3, 4, 5]), q(3, [1, 2])]
    held = {"a": np.array([1, 2], dtype=np.uint64), "b": np.zeros(0, dtype=np.uint64)}
    got = routed_hit_tokens(queries, ["a", "a", "b", "cloud"], held)
    # q0: 2 blocks in a's snapshot; q1: q0 (sent to a before it) puts its 3 blocks there;
    # q2 alone on an empty b; q3's instance has no model (a cloud one): unknown
    assert got == [200, 300, 0, None]
    # the same queries on one instance, in another order: the longer prompt first
    got2 = routed_hit_tokens([queries[1], queries[0]], ["b", "b"], held)
    assert got2 == [0, 300]


def test_lru_model_keeps_the_most_recent_within_capacity() -> None:
    lru = LruPrefixModel(capacity_tokens=1000.0)
    # a query's blocks are touched tail first, as vLLM frees them: its head is the most recent
    lru.touch(np.array([1, 2, 3], dtype=np.uint64), 300.0)
    lru.touch(np.array([4], dtype=np.uint64), 300.0)  # 1200 tokens: the tail 3 goes
    assert lru.cached().tolist() == [1, 2, 4] and lru.tokens == pytest.approx(900.0)
    lru.touch(np.array([2], dtype=np.uint64), 300.0)  # 2 is now the most recent
    lru.touch(np.array([5], dtype=np.uint64), 300.0)  # 1 goes, not 2
    assert lru.cached().tolist() == [2, 4, 5]
    lru.resize(400.0)
    assert lru.cached().tolist() == [5]
    # a chain that overflows the model keeps its leading blocks, which later prompts share
    lru = LruPrefixModel(capacity_tokens=900.0)
    lru.touch(np.array([7, 8, 9, 10, 11], dtype=np.uint64), 300.0)
    assert lru.cached().tolist() == [7, 8, 9] and lru.leading_blocks([7, 8, 9, 10]) == 3
    with pytest.raises(ValueError, match="capacity_tokens must be > 0"):
        LruPrefixModel(0.0)


def _prefixes(rng: np.random.Generator, n: int, roots: int) -> list[tuple[list[int], int]]:
    """Prompts that share prefixes: each extends one of a few roots by its own blocks."""
    out = []
    for _ in range(n):
        root = int(rng.integers(0, roots))
        shared = [root * 1000 + b for b in range(int(rng.integers(1, 20)))]
        own = rng.integers(10**6, 2**62, int(rng.integers(0, 10))).tolist()  # its own blocks
        hashes = shared + own
        out.append((hashes, len(hashes) * 512 - int(rng.integers(0, 400))))
    return out


@pytest.mark.parametrize(
    "sched",
    [
        SchedulerConfig(max_num_batched_tokens=4096, kv_blocks=60_000),
        SchedulerConfig(policy="sarathi", chunk_size_tokens=1024, kv_blocks=60_000),
        SchedulerConfig(policy="vllm-v0", max_num_batched_tokens=8192, kv_blocks=60_000),
    ],
    ids=["v1", "sarathi", "v0"],
)
def test_sfs_with_hits_and_warm_up_equals_the_engines_prefix_cache(sched: SchedulerConfig) -> None:
    """The engine's cache after some traffic gives the hits; new queries that share a prefix
    with an earlier one of the same list find what of it that one has computed by their
    admission — SFS's answer equals what the engine then does (no noise, oracle lengths,
    no eviction, residents done with their prefills: SFS does not know their hashes)."""
    rng = np.random.default_rng(3)
    warmed = 0
    for trial in range(8):
        eng = SimEngine(LinearTiming(M), sched, seed=trial)
        t = 0.0
        for i, (h, p) in enumerate(_prefixes(rng, int(rng.integers(1, 8)), 4)):
            t += float(rng.exponential(0.3))
            eng.submit(f"r{i}", t, p, int(rng.integers(1, 100)), prefix_hashes=h)
        eng.advance_to(t + float(rng.exponential(0.4)))
        while True:  # residents' own prefills would still fill the cache: let them finish
            snap = eng.snapshot(oracle=True)
            if (snap.prefilled_tokens == snap.prompt_tokens).all():
                break
            eng.advance_to(eng._now + 0.05)
        t = eng._now
        delay_ms = (eng.busy_until_s() - t) * 1e3
        new = _prefixes(rng, 4, 3)
        prompts = np.array([p for _, p in new])
        outs = rng.integers(1, 80, 4)
        wp = WindowPrefixes.build(
            [(np.array(h, dtype=np.uint64), 512.0) for h, _ in new], prompts
        )
        hits = wp.hit_tokens(eng.cached_hashes())
        est = estimate_ttft_ms(
            snap, prompts, M, sched, outs, start_delay_ms=delay_ms, hit_tokens=hits,
            shared_tokens=wp.shared_matrix(np.arange(4)), block_tokens=np.full(4, 512.0),
        )  # fmt: skip
        for j, (h, p) in enumerate(new):
            eng.submit(f"n{j}", t, p, int(outs[j]), prefix_hashes=h)
        eng.run_until_idle()
        rec = {r.request_id: r for r in eng.finished}
        real = np.array([rec[f"n{j}"].ttft_s * 1e3 for j in range(4)])
        np.testing.assert_allclose(est, real, rtol=1e-9)
        got = np.array([rec[f"n{j}"].cached_tokens for j in range(4)])
        assert (got >= hits).all()
        warmed += int((got > hits).sum())
    assert warmed > 0  # some queries were warmed by an earlier one of their window


def test_hits_make_sfs_faster_and_standalone_agrees_with_exact() -> None:
    sched = SchedulerConfig(max_num_batched_tokens=2048, kv_blocks=20_000)
    state = InstanceState(
        np.array([3000, 8000]), np.array([3000, 2000]), np.array([5, 0]), np.array([100, 50])
    )
    prompts = np.array([6000, 6000, 12_000])
    hits = np.array([0, 5000, 11_000])
    alone = standalone_ttft_ms(state, prompts, M, sched, hit_tokens=hits)
    exact = [
        estimate_ttft_ms(state, prompts[[i]], M, sched, np.array([50]), hit_tokens=hits[[i]])[0]
        for i in range(3)
    ]
    np.testing.assert_allclose(alone, exact, rtol=1e-9)
    assert alone[1] < alone[0]
    cold = standalone_ttft_ms(state, prompts, M, sched)
    assert cold[2] > 2 * alone[2]


def test_engine_counts_prefix_cache_queries_and_hits_like_vllm() -> None:
    eng = SimEngine(LinearTiming(M), SchedulerConfig(kv_blocks=10_000))
    eng.submit("a", 0.0, 2000, 5, prefix_hashes=[1, 2, 3, 4], prefix_block_tokens=500)
    eng.run_until_idle()
    eng.submit("b", eng._now, 2600, 5, prefix_hashes=[1, 2, 3, 9, 10], prefix_block_tokens=500)
    eng.run_until_idle()
    rec = {r.request_id: r for r in eng.finished}
    assert rec["a"].cached_tokens == 0 and rec["b"].cached_tokens == 1500
    assert (eng.prefix_cache.queries, eng.prefix_cache.hits) == (4600, 1500)
    assert rec["b"].ttft_s < rec["a"].ttft_s
    # both finished: every block is free (still cached) until the cache needs room
    assert eng.cached_hashes().tolist() == [1, 2, 3, 4, 9, 10]


def test_engine_evicts_least_recently_freed_blocks_tail_first_when_it_needs_room() -> None:
    eng = SimEngine(LinearTiming(M), SchedulerConfig(kv_blocks=250, block_size_tokens=16))
    eng.submit("a", 0.0, 2000, 2, prefix_hashes=[1, 2], prefix_block_tokens=1000)
    eng.run_until_idle()
    eng.submit("b", eng._now, 2000, 2, prefix_hashes=[5, 6], prefix_block_tokens=1000)
    eng.run_until_idle()
    # 4,000 tokens of cache: while b ran, a's free blocks had 1,999 tokens of room, so one
    # went: a's last, as vLLM frees a request's blocks tail first (its head is shared most)
    assert eng.cached_hashes().tolist() == [1, 5, 6]
    eng.submit("c", eng._now, 2000, 2, prefix_hashes=[1, 2], prefix_block_tokens=1000)
    eng.run_until_idle()
    assert {r.request_id: r.cached_tokens for r in eng.finished}["c"] == 1000  # the head hits


def test_blocks_shared_by_running_requests_are_one_copy_of_kv() -> None:
    from sim.prefix_cache import EnginePrefixCache

    cache = EnginePrefixCache()
    cache.acquire([1, 2, 3], 500.0)  # a computed three blocks
    cache.acquire([1, 2], 500.0)  # b hits two of them while a still runs
    assert cache.shared_tokens == 1000.0 and cache.free_tokens == 0.0
    cache.release([1, 2, 3])  # a finishes: its tail 3 is free, 1 and 2 still held by b
    assert cache.shared_tokens == 0.0 and cache.free_tokens == 500.0
    cache.release([1, 2])
    assert cache.free_tokens == 1500.0
    cache.evict_to(1000.0)  # the tail (freed first) goes, the head stays
    assert cache.leading_hits([1, 2, 3]) == 2
