"""SFS TTFT estimator: hand-computed answers, invariants, and exact agreement with the engine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.sfs import UNSERVABLE_MS, estimate_ttft_ms, standalone_ttft_ms
from routing.steptime import StepTimeModel
from routing.throughput_baseline import prefill_tokens_per_s, throughput_ttft_ms
from routing.types import InstanceState
from schemas import InstanceSnapshot, ResidentRequest, SchedulerConfig
from sim.engine import SimEngine
from sim.timing import LinearTiming

M = StepTimeModel(
    c0_ms=5.0, c1_ms_per_token=0.02, c2_ms_per_ctx_token=1e-4, c3_ms_per_attn_unit=1e-6
)
V1 = SchedulerConfig(max_num_batched_tokens=512)


def state(prompt, prefilled, decoded, output) -> InstanceState:  # type: ignore[no-untyped-def]
    return InstanceState(
        *(np.array(x, dtype=np.int64) for x in (prompt, prefilled, decoded, output))
    )


def step(n: float, dctx: float = 0.0, attn: float = 0.0) -> float:
    return 5.0 + 0.02 * n + 1e-4 * dctx + 1e-6 * attn


def test_one_request_on_an_empty_instance() -> None:
    got = estimate_ttft_ms(InstanceState.empty(), np.array([100]), M, V1)
    assert got[0] == pytest.approx(step(100, 0, 100 * 50))
    assert standalone_ttft_ms(InstanceState.empty(), np.array([100]), M, V1)[0] == pytest.approx(
        got[0]
    )


def test_two_requests_fcfs() -> None:
    # step 1: A=300 (done), B=212 chunk; step 2: A decodes (ctx 300), B's last 88 on 212
    got = estimate_ttft_ms(InstanceState.empty(), np.array([300, 300]), M, V1, np.array([5, 5]))
    s1 = step(512, 0, 300 * 150 + 212 * 106)
    s2 = step(89, 300, 88 * (44 + 212))
    assert got[0] == pytest.approx(s1)
    assert got[1] == pytest.approx(s1 + s2)


def test_a_prefill_split_into_chunks() -> None:
    got = estimate_ttft_ms(InstanceState.empty(), np.array([1200]), M, V1)
    want = (
        step(512, 0, 512 * 256) + step(512, 0, 512 * (256 + 512)) + step(176, 0, 176 * (88 + 1024))
    )
    assert got[0] == pytest.approx(want)


def test_decoding_residents_share_each_step() -> None:
    # two residents decoding (ctx 1000 and 2000 after this token), each with many tokens left
    s = state([1000, 2000], [1000, 2000], [1, 1], [100, 100])
    got = standalone_ttft_ms(s, np.array([400]), M, V1)
    assert got[0] == pytest.approx(step(402, 1000 + 2000, 400 * 200))


def test_preemption_when_kv_blocks_run_out() -> None:
    # 6 KV blocks of 4 tokens. Residents A, B: prompt 8, 5 tokens out (12 cached = 3 blocks
    # each), 2 more to go. Step 1: both need a 4th block -> B is preempted (re-queued with
    # a 13-token prompt); A decodes alone and nobody is admitted. Step 2: A's last token; B
    # (4 blocks) does not fit beside A, so the new query (FCFS behind B) waits too.
    # Step 3: B's 13-token re-prefill and the new 4-token prompt run together.
    sched = SchedulerConfig(max_num_batched_tokens=512, kv_blocks=6, block_size_tokens=4)
    s = state([8, 8], [8, 8], [5, 5], [7, 7])
    got = estimate_ttft_ms(s, np.array([4]), M, sched, np.array([1]))
    want = step(1, 12) + step(1, 13) + step(17, 0, 13 * 6.5 + 4 * 2)
    assert got[0] == pytest.approx(want)


def test_start_delay_is_added() -> None:
    a = standalone_ttft_ms(InstanceState.empty(), np.array([64]), M, V1)
    b = standalone_ttft_ms(InstanceState.empty(), np.array([64]), M, V1, start_delay_ms=7.5)
    assert b[0] == pytest.approx(a[0] + 7.5)


def test_vllm_v0_prefill_first() -> None:
    sched = SchedulerConfig(policy="vllm-v0", max_num_batched_tokens=512)
    s = state([1000], [1000], [1], [50])
    got = standalone_ttft_ms(s, np.array([300]), M, sched)
    assert got[0] == pytest.approx(step(300, 0, 300 * 150))  # the decode waits


# ---- invariants ----------------------------------------------------------------------------

residents = st.lists(
    st.tuples(
        st.integers(1, 3000),  # prompt
        st.sampled_from(["waiting", "prefilling", "decoding"]),
        st.integers(1, 300),  # output
        st.floats(0, 1),
    ),
    max_size=12,
)


def build(rs: list[tuple[int, str, int, float]]) -> InstanceState:
    p, pre, dec, out = [], [], [], []
    for prompt, phase, o, frac in rs:
        p.append(prompt)
        if phase == "waiting":
            pre.append(0), dec.append(0), out.append(o)
        elif phase == "prefilling":
            pre.append(max(1, int(frac * (prompt - 1))) if prompt > 1 else 0)
            dec.append(0)
            out.append(o)
        else:
            d = 1 + int(frac * (o - 1))
            pre.append(prompt), dec.append(d), out.append(max(o, d + 1))
    return state(p, pre, dec, out)


POLICIES = st.sampled_from(
    [
        SchedulerConfig(max_num_batched_tokens=512),
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8),
        SchedulerConfig(policy="sarathi", chunk_size_tokens=256),
        SchedulerConfig(max_num_batched_tokens=1024, shared_prefix_tokens=200),
    ]
)


@settings(max_examples=60, deadline=None)
@given(residents, st.integers(1, 4000), st.integers(1, 3000), POLICIES)
def test_ttft_never_decreases_when_work_is_queued_ahead(rs, prompt, extra, sched) -> None:  # type: ignore[no-untyped-def]
    s = build(rs)
    base = standalone_ttft_ms(s, np.array([prompt]), M, sched)[0]
    # a request queued ahead (after the residents, before the candidate): exact
    more = build([*rs, (extra, "waiting", 50, 0.0)])
    assert standalone_ttft_ms(more, np.array([prompt]), M, sched)[0] >= base - 1e-9
    # a longer prompt of the candidate itself: exact
    assert standalone_ttft_ms(s, np.array([prompt + extra]), M, sched)[0] >= base - 1e-9


@settings(max_examples=60, deadline=None)
@given(residents, st.integers(1, 4000), st.integers(1, 3000), POLICIES)
def test_ttft_barely_moves_down_when_a_decoding_resident_is_added(rs, prompt, extra, sched) -> None:  # type: ignore[no-untyped-def]
    """An extra decode takes a token of every step's budget, so an earlier request's prefill
    can end in the candidate's own last step instead of a step before it; that request then
    no longer decodes ahead of the candidate, which can *save* a little time (vLLM V1 does
    the same). The saving is bounded by that request's decode work: well under 2%."""
    s = build(rs)
    base = standalone_ttft_ms(s, np.array([prompt]), M, sched)[0]
    dec = build([*rs, (extra, "decoding", 300, 0.1)])
    assert standalone_ttft_ms(dec, np.array([prompt]), M, sched)[0] >= 0.98 * base


@settings(max_examples=60, deadline=None)
@given(residents, st.lists(st.integers(1, 4000), min_size=1, max_size=6), POLICIES)
def test_standalone_equals_the_reference_simulation(rs, prompts, sched) -> None:  # type: ignore[no-untyped-def]
    s = build(rs)
    fast = standalone_ttft_ms(s, np.array(prompts), M, sched)
    ref = [estimate_ttft_ms(s, np.array([p]), M, sched)[0] for p in prompts]
    np.testing.assert_allclose(fast, ref, rtol=1e-9)


@settings(max_examples=40, deadline=None)
@given(residents, st.integers(1, 4000), st.randoms(use_true_random=False), POLICIES)
def test_decoding_residents_order_does_not_matter(rs, prompt, rnd, sched) -> None:  # type: ignore[no-untyped-def]
    decoding = [r for r in rs if r[1] == "decoding"]
    shuffled = list(decoding)
    rnd.shuffle(shuffled)
    a = standalone_ttft_ms(build(decoding), np.array([prompt]), M, sched)
    b = standalone_ttft_ms(build(shuffled), np.array([prompt]), M, sched)
    np.testing.assert_allclose(a, b, rtol=1e-12)


def test_later_queries_wait_for_earlier_ones() -> None:
    got = estimate_ttft_ms(InstanceState.empty(), np.array([900, 900, 900]), M, V1)
    assert (np.diff(got) > 0).all()


# ---- SFS equals the engine -----------------------------------------------------------------


@pytest.mark.parametrize(
    "sched",
    [
        SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16),
        SchedulerConfig(max_num_batched_tokens=2048, kv_blocks=600, block_size_tokens=16),
        SchedulerConfig(policy="sarathi", chunk_size_tokens=256),
        SchedulerConfig(policy="vllm-v0", max_num_batched_tokens=2048),
        SchedulerConfig(max_num_batched_tokens=512, shared_prefix_tokens=128),
    ],
    ids=["v1", "v1-kv-preemption", "sarathi", "v0", "prefix"],
)
def test_sfs_equals_engine_with_fitted_model_no_noise_oracle_lengths(
    sched: SchedulerConfig,
) -> None:
    rng = np.random.default_rng(7)
    for trial in range(8):
        eng = SimEngine(LinearTiming(M), sched, seed=trial)
        t = 0.0
        for i in range(int(rng.integers(0, 30))):
            t += float(rng.exponential(0.05))
            eng.submit(f"r{i}", t, int(rng.integers(1, 2000)), int(rng.integers(1, 200)))
        t += float(rng.exponential(0.2))
        eng.advance_to(t)
        snap = eng.snapshot(oracle=True)
        delay_ms = (eng.busy_until_s() - t) * 1e3
        prompts = rng.integers(1, 2000, 3)
        outs = rng.integers(1, 100, 3)
        est = estimate_ttft_ms(snap, prompts, M, sched, outs, start_delay_ms=delay_ms)
        for j in range(3):
            eng.submit(f"n{j}", t, int(prompts[j]), int(outs[j]))
        eng.run_until_idle()
        rec = {r.request_id: r for r in eng.finished}
        real = np.array([rec[f"n{j}"].ttft_s * 1e3 for j in range(3)])
        np.testing.assert_allclose(est, real, rtol=1e-9)


# ---- bad input -----------------------------------------------------------------------------


def test_bad_snapshots_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="token counts must be >= 0"):
        state([-1], [0], [0], [1])
    with pytest.raises(
        ValueError, match=r"row 0: prefilled_tokens \(20\) must be <= prompt_tokens \(10\)"
    ):
        state([10], [20], [0], [1])
    with pytest.raises(
        ValueError, match="row 1: decoded_tokens .* must be 0 until the prompt is fully"
    ):
        standalone_ttft_ms(state([10, 10], [10, 5], [1, 2], [5, 5]), np.array([10]), M, V1)
    with pytest.raises(ValueError, match="row 0: predicted_output_tokens must be >= 1"):
        standalone_ttft_ms(state([10], [10], [1], [0]), np.array([10]), M, V1)
    with pytest.raises(ValueError, match=r"prompt_tokens\[1\] must be >= 0, got -3"):
        standalone_ttft_ms(InstanceState.empty(), np.array([5, -3]), M, V1)
    with pytest.raises(ValueError, match="1-D array"):
        estimate_ttft_ms(InstanceState.empty(), np.array([[5]]), M, V1)
    with pytest.raises(ValueError, match="output_tokens has 1 rows, prompt_tokens has 2"):
        estimate_ttft_ms(InstanceState.empty(), np.array([5, 6]), M, V1, np.array([3]))


def test_wire_snapshot_round_trip() -> None:
    snap = InstanceSnapshot(
        instance_id="i1",
        model="m",
        taken_at=0.0,
        residents=[
            ResidentRequest(
                query_id="a", prompt_tokens=500, prefilled_tokens=500, decoded_tokens=3
            ),
            ResidentRequest(query_id="b", prompt_tokens=800, prefilled_tokens=0),
        ],
    )
    s = InstanceState.from_snapshot(snap)
    assert (
        standalone_ttft_ms(s, np.array([100]), M, V1)[0]
        > standalone_ttft_ms(InstanceState.empty(), np.array([100]), M, V1)[0]
    )


def test_throughput_baseline_ignores_decodes() -> None:
    s = state([1000, 500], [1000, 100], [1, 0], [50, 50])
    tps = prefill_tokens_per_s(M, V1)
    got = throughput_ttft_ms(s, np.array([600]), tps)
    assert got[0] == pytest.approx((400 + 600) / tps * 1e3)
    with pytest.raises(ValueError, match="tokens_per_s must be a finite number > 0"):
        throughput_ttft_ms(s, np.array([1]), 0.0)


def test_standalone_answers_when_a_big_candidate_must_wait_for_kv_blocks() -> None:
    """A nearly full KV cache: a small candidate starts at once, a big one must wait for
    residents to finish. Once raised "needs N KV blocks" and crashed the router."""
    n = 30
    state = InstanceState(
        prompt_tokens=np.full(n, 1300, dtype=np.int64),
        prefilled_tokens=np.full(n, 1300, dtype=np.int64),
        decoded_tokens=np.full(n, 10, dtype=np.int64),
        predicted_output_tokens=np.arange(200, 200 + 20 * n, 20, dtype=np.int64),
    )
    model = StepTimeModel(5.0, 0.02, 1e-4, 1e-6)
    sched = SchedulerConfig(kv_blocks=2537, max_num_batched_tokens=8192)
    got = standalone_ttft_ms(state, np.array([100, 2417, 10**6], dtype=np.int64), model, sched)
    assert np.isfinite(got).all()
    assert got[1] == pytest.approx(estimate_ttft_ms(state, np.array([2417]), model, sched)[0])
    assert got[1] > got[0]
    assert got[2] == UNSERVABLE_MS  # more blocks than the whole cache


def _first_over(ttft: np.ndarray, bound: np.ndarray, added: float) -> int:
    bad = np.flatnonzero((ttft + added > bound) & (bound < np.inf))
    return int(bad[0]) if bad.size else -1


@settings(max_examples=80, deadline=None)
@given(
    residents,
    st.lists(
        st.tuples(st.integers(1, 3000), st.integers(1, 400), st.floats(5.0, 3000.0), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([0.0, 7.5]),
    POLICIES,
)
def test_over_ms_stops_at_the_first_query_over_its_bound(rs, new, added, sched) -> None:  # type: ignore[no-untyped-def]
    """With bounds, the simulation may stop early: the TTFTs it returns are the full
    simulation's, the first query over its bound is the same one (its TTFT then a lower
    bound already over it), and without one over it the answer is the full one."""
    s = build(rs)
    prompts = np.array([p for p, _, _, _ in new])
    outs = np.array([o for _, o, _, _ in new])
    bound = np.array([np.inf if free else b for _, _, b, free in new])
    full = estimate_ttft_ms(s, prompts, M, sched, outs, start_delay_ms=3.0)
    got = estimate_ttft_ms(
        s, prompts, M, sched, outs, start_delay_ms=3.0, over_ms=bound, added_ms=added
    )
    first = _first_over(full, bound, added)
    assert _first_over(got, bound, added) == first
    if first < 0:
        np.testing.assert_array_equal(got, full)
        return
    known = ~np.isnan(got)
    known[first] = False
    np.testing.assert_array_equal(got[known], full[known])
    assert got[first] <= full[first]
    # every query before the first over is answered (or has no bound)
    before = np.arange(first)
    assert (known[before] | (bound[before] == np.inf)).all()


def test_over_ms_saves_the_queue_behind_a_violation() -> None:
    """Four hundred short queries on a 256-seat instance: the 257th waits for a whole
    batch; with a 2 s bound the simulation stops there and leaves the rest unanswered."""
    sched = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256)
    prompts = np.full(400, 12)
    outs = np.full(400, 256)
    full = estimate_ttft_ms(InstanceState.empty(), prompts, M, sched, outs)
    got = estimate_ttft_ms(
        InstanceState.empty(), prompts, M, sched, outs, over_ms=np.full(400, 2000.0)
    )
    assert _first_over(full, np.full(400, 2000.0), 0.0) == 256
    np.testing.assert_array_equal(got[:256], full[:256])
    assert 2000.0 < got[256] <= full[256]
    assert np.isnan(got[257:]).all()
