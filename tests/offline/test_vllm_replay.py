"""``offline.vllm_replay.evaluate``: MAPE of SFS, the simulated engine and the throughput rule
against recorded TTFTs (pure; the replay itself runs against real vLLM in bench/real_vllm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from offline.vllm_replay import ReplayRecord, evaluate, server_ms_of
from routing.steptime import StepTimeModel
from schemas import SchedulerConfig
from sim.timing import LinearTiming

M = StepTimeModel(
    c0_ms=10.0, c1_ms_per_token=1.0, c2_ms_per_ctx_token=0.002, c3_ms_per_attn_unit=0.0
)
SCHED = SchedulerConfig(
    max_num_batched_tokens=512, max_num_seqs=16, kv_blocks=2048, block_size_tokens=128
)


def _rec(
    i: int, sent_s: float, prompt: int, ttft_ms: float, residents: list[list[float]]
) -> ReplayRecord:
    r = ReplayRecord(f"r{i}", sent_s, prompt, 8, sent_s=sent_s, ttft_s=ttft_ms / 1e3, e2e_s=1.0)
    r.generated_tokens = 8
    r.residents = residents
    return r


def test_an_idle_server_is_priced_by_one_prefill_step() -> None:
    recs = [_rec(i, 10.0 * i, 100, 110.0, []) for i in range(4)]  # 10 + 1 x 100 tokens
    ev = evaluate(recs, M, SCHED, engine_timing=LinearTiming(M))
    assert ev["n"] == 4 and ev["errors"] == 0
    assert ev["mape_sfs_predicted"] == pytest.approx(0.0, abs=1e-9)
    assert ev["mape_sfs_plain"] == pytest.approx(0.0, abs=1e-9)
    assert ev["mape_sim_engine"] == pytest.approx(0.0, abs=1e-9)
    off = evaluate(recs, M, SCHED, server_ms=11.0)
    assert off["mape_sfs_real_lengths"] == pytest.approx(0.1)
    assert off["mape_sfs_plain"] == pytest.approx(0.0, abs=1e-9)  # before: no server time


def test_server_time_is_calibrated_on_lone_requests() -> None:
    lone = [_rec(i, float(i), 100, t, []) for i, t in enumerate((113.0, 117.0, 200.0))]
    busy = _rec(9, 9.0, 100, 900.0, [[100, 100, 3, 8, 50.0]])
    assert server_ms_of([*lone, busy], M) == pytest.approx(7.0)  # median of 3, 7, 90
    with pytest.raises(ValueError, match="idle"):
        server_ms_of([busy], M)


def test_queued_prompts_delay_the_estimate_and_errors_are_counted() -> None:
    busy = [[400, 0, 0, 8]]  # a 400-token prompt waiting ahead (no age: just sent)
    recs = [_rec(0, 0.0, 100, 510.0, busy), _rec(1, 5.0, 100, 110.0, [])]
    bad = ReplayRecord("x", 1.0, 10, 1, error="HTTP 400: too long")
    ev = evaluate([*recs, bad], M, SCHED)
    assert ev["errors"] == 1 and ev["n"] == 2
    assert ev["mean_ms_sfs_real_lengths"] > 300  # the waiting prompt is prefilled first
    assert np.isfinite(ev["mape_throughput_baseline"])
    with pytest.raises(ValueError, match="no request"):
        evaluate([bad], M, SCHED)


def test_a_waiting_resident_is_credited_with_its_time_at_the_engine() -> None:
    # a 1,000-token prompt sent 300 ms before: its first 512-token step (522 ms) is in
    # flight, 222 ms from its end; then its last 488 tokens with the new prompt's first 24
    # (522 ms); then the new prompt's last 76 beside the old one's first decode (10 + 77 +
    # 0.002 x 1,000 context tokens)
    recs = [_rec(0, 0.0, 100, 833.0, [[1000, 0, 0, 8, 300.0]])]
    ev = evaluate(recs, M, SCHED)
    assert ev["mean_ms_sfs_real_lengths"] == pytest.approx(222.0 + 522.0 + 89.0, abs=0.5)
    # the plain snapshot prices the whole prompt from now: one more 522-ms step's worth
    assert ev["mean_ms_sfs_plain"] == pytest.approx(522.0 + 522.0 + 89.0, abs=0.5)


def test_a_request_that_finished_before_the_send_took_its_step_from_the_waiting_one() -> None:
    # r0: a 400-token prompt, 1 output token, sent at 0 and done at 0.42 s (its step: 10 +
    # 400 = 410 ms); r1: a 300-token prompt sent at 0.4 s, still waiting at r2's send at
    # 0.5 s. The replay from r0's arrival: r0's step until 0.41 s, then r1's (310 ms) until
    # 0.72 s: 220 ms after r2's send; then r2's 100 tokens beside r1's decode (10 + 101 +
    # 0.002 x 300 context tokens = 111.6 ms). Residents only, r1's step runs from its
    # arrival (0.4 s) to 0.71 s: 10 ms less
    r0 = ReplayRecord("r0", 0.0, 400, 1, sent_s=0.0, ttft_s=0.41, e2e_s=0.42)
    r0.generated_tokens = 1
    r1 = _rec(1, 0.4, 300, 330.0, [])
    r1.output_tokens = r1.generated_tokens = 8
    r2 = _rec(2, 0.5, 100, 331.6, [[300, 0, 0, 8, 100.0]])
    r2.finished = [[400, 1, 500.0, 80.0]]
    ev = evaluate([r0, r1, r2], M, SCHED)
    # r0 and r1 were sent to an idle server: 410 and 310 ms
    got = ev["mean_ms_sfs_real_lengths"] * 3 - 410.0 - 310.0
    assert got == pytest.approx(220.0 + 111.6, abs=0.5)
    alone = ev["mean_ms_sfs_residents_real_lengths"] * 3 - 410.0 - 310.0
    assert alone == pytest.approx(210.0 + 111.6, abs=0.5)
    # the same when the record predates the field: the level's records give it
    r2.finished = None
    again = evaluate([r0, r1, r2], M, SCHED)
    assert again["mean_ms_sfs_real_lengths"] == pytest.approx(ev["mean_ms_sfs_real_lengths"])


def test_predicted_lengths_are_conditioned_on_what_each_resident_decoded() -> None:
    # a resident 62 tokens into a 200-token output; no request finished before the send among
    # the records, so the flat prediction is the default 64: it would leave after 2 more
    # steps. The worker's recent list holds ten finished lengths; the four above 62 (80, 120,
    # 200, 250) average 162.5: it stays beside the candidate's three 511-token chunks, as
    # with its real length.
    r = _rec(0, 0.0, 1500, 1600.0, [[100, 100, 62, 200, 4000.0]])
    r.finished = [[64, n, 3000.0, 100.0] for n in (10, 20, 30, 40, 50, 60, 80, 120, 200, 250)]
    ev = evaluate([r], M, SCHED)
    assert ev["mean_ms_sfs_predicted"] == pytest.approx(ev["mean_ms_sfs_real_lengths"])
    assert ev["mean_ms_sfs_later_predicted"] == pytest.approx(ev["mean_ms_sfs_later_real_lengths"])
    assert ev["mean_ms_sfs_predicted"] > ev["mean_ms_sfs_predicted_flat"] + 0.5
    assert ev["mean_ms_sfs_later_predicted"] > ev["mean_ms_sfs_later_predicted_flat"] + 0.5
