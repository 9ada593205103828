"""``routing.sfs.catch_up``: a snapshot whose engine reports no prefill progress (a real vLLM)
caught up to the present: prefill done since each resident arrived, and the step in flight."""

from __future__ import annotations

import numpy as np
import pytest

from routing.sfs import catch_up, estimate_ttft_ms, standalone_ttft_ms
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig

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
