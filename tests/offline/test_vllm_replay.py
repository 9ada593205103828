"""``offline.vllm_replay.evaluate``: MAPE of SFS, the simulated engine and the throughput rule
against recorded TTFTs (pure; the replay itself runs against real vLLM in bench/real_vllm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from offline.vllm_replay import ReplayRecord, evaluate
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
    i: int, sent_s: float, prompt: int, ttft_ms: float, residents: list[list[int]]
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
    assert ev["mape_sim_engine"] == pytest.approx(0.0, abs=1e-9)
    off = evaluate(recs, M, SCHED, overhead_ms=11.0)
    assert off["mape_sfs_real_lengths"] == pytest.approx(0.1)


def test_queued_prompts_delay_the_estimate_and_errors_are_counted() -> None:
    busy = [[400, 0, 0, 8]]  # a 400-token prompt waiting ahead
    recs = [_rec(0, 0.0, 100, 510.0, busy), _rec(1, 5.0, 100, 110.0, [])]
    bad = ReplayRecord("x", 1.0, 10, 1, error="HTTP 400: too long")
    ev = evaluate([*recs, bad], M, SCHED)
    assert ev["errors"] == 1 and ev["n"] == 2
    assert ev["mean_ms_sfs_real_lengths"] > 300  # the waiting prompt is prefilled first
    assert np.isfinite(ev["mape_throughput_baseline"])
    with pytest.raises(ValueError, match="no request"):
        evaluate([bad], M, SCHED)


def test_a_busy_engine_adds_half_its_step_in_flight() -> None:
    from offline.vllm_replay import in_flight_ms

    assert in_flight_ms([], M, SCHED) == 0.0
    # two decodes at 100 + 3 tokens of context: half of c0 + 2 tokens + 206 ctx tokens
    assert in_flight_ms([[100, 100, 3, 8], [100, 100, 3, 8]], M, SCHED) == pytest.approx(
        0.5 * (10.0 + 2.0 + 0.002 * 206)
    )
    # a waiting 1,000-token prompt: the step takes the 512-token budget
    assert in_flight_ms([[1000, 0, 0, 8]], M, SCHED) == pytest.approx(0.5 * (10.0 + 512.0))
    recs = [_rec(0, 0.0, 100, 400.0, [[1000, 0, 0, 8]])]
    a = evaluate(recs, M, SCHED)["mean_ms_sfs_real_lengths"]
    b = evaluate(recs, M, SCHED, step_in_flight=True)["mean_ms_sfs_real_lengths"]
    assert b == pytest.approx(a + 261.0, abs=0.2)
