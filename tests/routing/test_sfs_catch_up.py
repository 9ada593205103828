"""``routing.sfs.catch_up``: a snapshot whose engine reports no prefill progress (a real vLLM)
caught up to the present: prefill done since each resident arrived, and the step in flight."""

from __future__ import annotations

import numpy as np
import pytest

from routing.sfs import (
    LaterArrivals,
    _finished_in_replay,
    catch_up,
    estimate_ttft_ms,
    later_arrivals,
    standalone_ttft_ms,
    with_conditional_lengths,
)
from routing.steptime import StepTimeModel
from routing.types import InstanceState, RecentFinished
from schemas import SchedulerConfig
from sim.engine import SimEngine
from sim.timing import LinearTiming

M = StepTimeModel(c0_ms=5.0, c1_ms_per_token=0.1, c2_ms_per_ctx_token=0.0, c3_ms_per_attn_unit=0.0)
SCHED = SchedulerConfig(
    max_num_batched_tokens=512, max_num_seqs=16, kv_blocks=2048, block_size_tokens=128
)


def _state(rows: list[tuple[int, int, int, int]]) -> InstanceState:
    a = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return InstanceState(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def test_an_empty_instance_is_unchanged_and_the_engine_idle() -> None:
    st, delay = catch_up(InstanceState.empty(), np.zeros(0), M, SCHED)
    assert st.n == 0 and delay == 0.0


def test_a_waiting_prompt_is_in_the_step_in_flight_until_that_step_ends() -> None:
    waiting = _state([(400, 0, 0, 10)])  # one 400-token step: 5 + 40 = 45 ms
    for waited, left in ((0.0, 45.0), (10.0, 35.0), (44.0, 1.0)):
        st, delay = catch_up(waiting, np.array([waited]), M, SCHED)
        assert delay == pytest.approx(left)
        # after the step in flight its prompt is done and its first token on the way
        assert (int(st.prefilled_tokens[0]), int(st.decoded_tokens[0])) == (400, 1)
    # 46 ms after it arrived its prefill is over and a decode step (5.1 ms) is in flight
    st, delay = catch_up(waiting, np.array([46.0]), M, SCHED)
    assert delay == pytest.approx(45.0 + 5.1 - 46.0)


def test_a_long_prompt_is_credited_the_chunks_already_run() -> None:
    # 1,200 tokens in 512-token chunks (56.2 ms each): after 60 ms one chunk is done and the
    # second is in flight, 52.4 ms from its end; then 176 tokens remain
    st, delay = catch_up(_state([(1200, 0, 0, 10)]), np.array([60.0]), M, SCHED)
    assert int(st.prefilled_tokens[0]) == 1024 and int(st.decoded_tokens[0]) == 0
    assert delay == pytest.approx(2 * 56.2 - 60.0)
    new = np.array([50], dtype=np.int64)
    # the new prompt joins the last chunk's step: 176 + 50 tokens
    assert standalone_ttft_ms(st, new, M, SCHED, start_delay_ms=delay)[0] == pytest.approx(
        delay + 5.0 + 0.1 * 226
    )


def test_decodes_only_leave_half_a_step_in_flight() -> None:
    dec = _state([(100, 100, 5, 50), (80, 80, 2, 50)])
    st, delay = catch_up(dec, np.array([500.0, 300.0]), M, SCHED)
    assert delay == pytest.approx(0.5 * (5.0 + 0.1 * 2))
    assert np.array_equal(st.prefilled_tokens, dec.prefilled_tokens)


def test_waiting_residents_join_fcfs_at_step_boundaries_behind_the_decodes() -> None:
    # a decode that arrived 900 ms ago and two waiting prompts that arrived 30 and 3 ms ago
    st = _state([(100, 100, 5, 50), (300, 0, 0, 10), (200, 0, 0, 10)])
    out, delay = catch_up(st, np.array([900.0, 30.0, 3.0]), M, SCHED)
    # the decode's own prefill (15 ms) and its 5.1-ms steps: the one running at -30 ms ends
    # at -900 + 15 + 168 x 5.1 = -28.2 ms; then the 300 tokens beside the decode (5 + 30.1
    # ms) run until 6.9 ms from now; the second prompt arrived during that step
    assert delay == pytest.approx(-900.0 + 15.0 + 168 * 5.1 + 35.1)
    assert out.prefilled_tokens.tolist() == [100, 300, 0]
    assert out.decoded_tokens.tolist() == [5, 1, 0]
    # the estimate from the caught-up state is below the one from the raw snapshot
    new = np.array([64], dtype=np.int64)
    raw = estimate_ttft_ms(st, new, M, SCHED)[0]
    caught = estimate_ttft_ms(out, new, M, SCHED, start_delay_ms=delay)[0]
    assert caught < raw


def test_bad_ages_are_refused() -> None:
    st = _state([(100, 0, 0, 10)])
    with pytest.raises(ValueError, match="shape"):
        catch_up(st, np.zeros(2), M, SCHED)
    with pytest.raises(ValueError, match="finite"):
        catch_up(st, np.array([np.nan]), M, SCHED)


def _done(rows: list[tuple[int, int, float, float]]) -> RecentFinished:
    return RecentFinished.of(rows)


def test_a_request_that_left_took_the_steps_before_the_waiting_one() -> None:
    # a 400-token prompt with one output token arrived 60 ms ago and left 10 ms ago; a
    # 300-token prompt arrived 50 ms ago. The first one's step (5 + 40 = 45 ms) ran until
    # -15 ms, so the second one's (5 + 30 = 35 ms) runs until 20 ms from now
    st = _state([(300, 0, 0, 10)])
    out, delay = catch_up(st, np.array([50.0]), M, SCHED, _done([(400, 1, 60.0, 10.0)]))
    assert delay == pytest.approx(-60.0 + 45.0 + 35.0)
    assert (int(out.prefilled_tokens[0]), int(out.decoded_tokens[0])) == (300, 1)
    # without it the replay gives the engine to the waiting prompt at once: done by -15 ms,
    # then its decode steps (5.1 ms): the third ends 0.3 ms from now
    _, alone = catch_up(st, np.array([50.0]), M, SCHED)
    assert alone == pytest.approx(-50.0 + 35.0 + 3 * 5.1)


def test_a_finished_request_decodes_beside_the_waiting_prompt_until_its_output_is_done() -> None:
    # 400 tokens and 3 outputs, arrived 70 ms ago: prefill -70..-25 ms; then its decode (1
    # token) shares the 300-token prompt's step: 5 + 0.1 * 301 = 35.1 ms, until 10.1 ms
    st = _state([(300, 0, 0, 10)])
    _, delay = catch_up(st, np.array([50.0]), M, SCHED, _done([(400, 3, 70.0, 5.0)]))
    assert delay == pytest.approx(-70.0 + 45.0 + 35.1)


def test_requests_that_left_before_the_replay_starts_are_not_replayed() -> None:
    st = _state([(300, 0, 0, 10)])
    plain = catch_up(st, np.array([50.0]), M, SCHED)
    gone = catch_up(st, np.array([50.0]), M, SCHED, _done([(400, 1, 500.0, 100.0)]))
    assert gone[1] == plain[1] == pytest.approx(-50.0 + 35.0 + 3 * 5.1)
    assert np.array_equal(gone[0].prefilled_tokens, plain[0].prefilled_tokens)


def test_a_finished_request_that_arrived_earlier_moves_the_replay_start_back() -> None:
    # the waiting prompt arrived 50 ms ago; A (left 40 ms ago) arrived 200 ms ago, so the
    # replay starts then; B left 150 ms ago, after that start, and arrived 300 ms ago: the
    # replay starts at -300 ms; C left 350 ms ago, before it, and is not replayed
    done = _done([(100, 1, 200.0, 40.0), (100, 1, 300.0, 150.0), (100, 1, 400.0, 350.0)])
    rows, start = _finished_in_replay(done, -50.0)
    assert rows.tolist() == [0, 1] and start == -300.0


def test_the_caught_up_snapshot_matches_the_simulated_engine_given_its_whole_past() -> None:
    """With every request that left since the replay starts, exact Eq. 9 step times and
    FCFS, the replay is the engine: the step in flight ends when the engine's does, and
    SFS on the caught-up snapshot gives a new request the engine's own TTFT."""
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(40):
        n = 12
        arrival_s = np.sort(rng.uniform(0.0, 0.4, n))
        prompt = rng.integers(20, 600, n)
        output = rng.integers(1, 4, n)
        t_now = float(rng.uniform(0.1, 0.5))
        eng = SimEngine(LinearTiming(M), SCHED)
        for i in range(n):
            if arrival_s[i] < t_now:
                eng.submit(str(i), float(arrival_s[i]), int(prompt[i]), int(output[i]))
        eng.advance_to(t_now)
        left = {int(f.request_id): f for f in eng.finished}
        sent = [i for i in range(n) if arrival_s[i] < t_now]
        residents = [i for i in sent if i not in left]
        if not residents:
            continue
        firsts = {e.request_id for e in eng.advance_to(t_now)}  # none held back
        assert not firsts
        # residents that got their first token before now decode: skip such draws (their
        # token counts as streamed are not what this test is about)
        if any(eng._first[int(np.flatnonzero(np.array(eng._ids) == str(i))[0])] <= t_now
               for i in residents):  # fmt: skip
            continue
        st = _state([(int(prompt[i]), 0, 0, int(output[i])) for i in residents])
        waited = np.array([(t_now - arrival_s[i]) * 1e3 for i in residents])
        done = _done(
            [
                (int(prompt[i]), int(output[i]), (t_now - f.arrival_s) * 1e3,
                 (t_now - f.finish_s) * 1e3)
                for i, f in left.items()
            ]
        )  # fmt: skip
        caught, delay = catch_up(st, waited, M, SCHED, done)
        assert delay == pytest.approx((eng.busy_until_s() - t_now) * 1e3, abs=1e-6)
        new = 64
        eng.submit("new", t_now, new, 1)
        eng.run_until_idle()
        real = next(f for f in eng.finished if f.request_id == "new").ttft_s * 1e3
        est = standalone_ttft_ms(caught, np.array([new]), M, SCHED, start_delay_ms=delay)[0]
        assert est == pytest.approx(real, abs=1e-6)
        checked += 1
    assert checked >= 10


def _poisson_min(mu: float, left: float, prompt: float, seats: int) -> float:
    """E[min(left, min(N, seats) x prompt)] for N ~ Poisson(mu), term by term."""
    import math

    return sum(
        math.exp(-mu) * mu**k / math.factorial(k) * min(left, min(k, seats) * prompt)
        for k in range(60)
    )


def test_later_arrivals_join_the_candidates_last_step_with_the_budget_it_leaves() -> None:
    # an idle engine with a 50-ms step in flight: a 100-token candidate's only step starts
    # in 50 ms and leaves 412 tokens; requests arrive at 0.02/ms (1 expected meanwhile),
    # 100 tokens each: its step is longer by 0.1 ms x E[min(412, N x 100)]
    empty = InstanceState.empty()
    new = np.array([100], dtype=np.int64)
    alone = standalone_ttft_ms(empty, new, M, SCHED, start_delay_ms=50.0)[0]
    assert alone == pytest.approx(50.0 + 5.0 + 10.0)
    later = LaterArrivals(rate_per_ms=0.02, prompt_tokens=100.0)
    got = standalone_ttft_ms(empty, new, M, SCHED, start_delay_ms=50.0, later=later)[0]
    assert got == pytest.approx(alone + 0.1 * _poisson_min(1.0, 412.0, 100.0, 15))
    # nobody arriving, or the step starting now: nothing to add
    none = LaterArrivals(rate_per_ms=0.0, prompt_tokens=100.0)
    assert standalone_ttft_ms(empty, new, M, SCHED, start_delay_ms=50.0, later=none)[0] == (
        pytest.approx(alone)
    )
    assert standalone_ttft_ms(empty, new, M, SCHED, later=later)[0] == pytest.approx(15.0)


def test_later_arrivals_find_no_seat_when_the_batch_is_full() -> None:
    # 15 decoding residents and the candidate fill max_num_seqs (16): nobody joins
    full = _state([(50, 50, 1, 1000)] * 15)
    new = np.array([100], dtype=np.int64)
    later = LaterArrivals(rate_per_ms=1.0, prompt_tokens=100.0)
    base = standalone_ttft_ms(full, new, M, SCHED, start_delay_ms=20.0)[0]
    assert standalone_ttft_ms(full, new, M, SCHED, start_delay_ms=20.0, later=later)[0] == (
        pytest.approx(base)
    )


def test_the_arrival_rate_is_read_from_the_residents_and_the_finished_requests() -> None:
    st = _state([(100, 0, 0, 10), (300, 0, 0, 10), (50, 50, 3, 10)])
    done = _done([(200, 2, 400.0, 100.0), (1000, 2, 1500.0, 900.0)])  # the second: too old
    got = later_arrivals(st, np.array([100.0, 2000.0, 0.0]), done, window_ms=1000.0)
    # within the last second: the first resident (the third's age is unknown) and the first
    # finished request
    assert got.rate_per_ms == pytest.approx(2 / 1000.0)
    assert got.prompt_tokens == pytest.approx(150.0)
    assert later_arrivals(InstanceState.empty(), np.zeros(0)).rate_per_ms == 0.0
    with pytest.raises(ValueError, match="rate_per_ms"):
        LaterArrivals(rate_per_ms=-1.0, prompt_tokens=10.0)


def test_decoding_residents_get_lengths_conditional_on_what_they_decoded() -> None:
    """``with_conditional_lengths``: each decoding resident is predicted the mean of the
    recently finished lengths above its decoded count; a waiting one keeps its own."""
    # eight finished: 2, 4, 6, 8, 10, 30, 50, 100 tokens (sum 210)
    fin = RecentFinished.of([(64, n, 900.0, 100.0) for n in (2, 4, 6, 8, 10, 30, 50, 100)])
    st = _state([(100, 100, 5, 20), (100, 100, 40, 41), (300, 0, 0, 20)])
    got = with_conditional_lengths(st, fin)
    # d=5: (6+8+10+30+50+100)/6 = 34; d=40: 50 and 100 only, memoryless past t*=29 with
    # e0 = (30+50+100)/3 - 29 = 31 -> 71; waiting: its own 20
    np.testing.assert_array_equal(got.predicted_output_tokens, [34, 71, 20])
    np.testing.assert_array_equal(got.decoded_tokens, st.decoded_tokens)
    np.testing.assert_array_equal(got.prefilled_tokens, st.prefilled_tokens)
    assert with_conditional_lengths(st, None) is st
    few = RecentFinished.of([(64, n, 900.0, 100.0) for n in (2, 4, 6)])
    assert with_conditional_lengths(st, few) is st  # three finished: too few to condition on
