"""Scheduling policies: hand-computed batches (vLLM V1, Sarathi-Serve, vLLM V0)."""

from __future__ import annotations

import numpy as np
import pytest

from routing.scheduling import SchedulingError, Workload
from schemas import SchedulerConfig


def wl(prompt, prefilled, decoded, output, **kw) -> Workload:  # type: ignore[no-untyped-def]
    a = [np.array(x, dtype=np.int64) for x in (prompt, prefilled, decoded, output)]
    return Workload(*a, SchedulerConfig(**kw))


def run_all(w: Workload) -> list[tuple[int, dict[int, int]]]:
    """Every segment as (steps, {original row: tokens}) until the workload drains."""
    ids = np.arange(w.n)
    out = []
    for _ in range(1000):
        seg = w.plan()
        if seg is None:
            return out
        out.append((seg.steps, dict(zip(ids[seg.rows].tolist(), seg.tokens.tolist(), strict=True))))
        done = w.apply(seg)
        if done.finished.size:
            w.remove(done.finished)
            ids = np.delete(ids, done.finished)
    raise AssertionError("workload did not drain")


def test_one_request_on_an_empty_instance() -> None:
    w = wl([100], [0], [0], [3], max_num_batched_tokens=512)
    seg = w.plan()
    assert seg is not None and seg.steps == 1 and seg.rows.tolist() == [0]
    assert seg.tokens.tolist() == [100] and seg.n_admitted == 1
    done = w.apply(seg)
    assert done.first_token.tolist() == [0] and w.decoded[0] == 1
    seg = w.plan()
    assert seg is not None and seg.steps == 2 and seg.n_decode == 1  # two more tokens
    assert seg.decode_ctx0 == 100  # the prompt is cached; output token 1 is being fed
    done = w.apply(seg)
    assert done.finished.tolist() == [0]


def test_two_requests_fcfs_share_the_budget() -> None:
    w = wl([300, 300], [0, 0], [0, 0], [5, 5], max_num_batched_tokens=512)
    seg = w.plan()
    assert seg is not None
    assert dict(zip(seg.rows.tolist(), seg.tokens.tolist(), strict=True)) == {0: 300, 1: 212}
    w.apply(seg)
    seg = w.plan()
    assert seg is not None
    # running first: A decodes (1 token), B finishes its prefill (88)
    assert dict(zip(seg.rows.tolist(), seg.tokens.tolist(), strict=True)) == {0: 1, 1: 88}
    assert seg.steps == 1


def test_a_long_prefill_is_split_into_chunks() -> None:
    w = wl([1200], [0], [0], [1], max_num_batched_tokens=512)
    segs = run_all(w)
    # 512 (admission), then 512 (same chunk, one segment would need the same row state),
    # then the 176-token tail
    tokens = [t for steps, rows in segs for t in [rows[0]] * steps]
    assert tokens == [512, 512, 176]
    seg_ctx = wl([1200], [512], [0], [1], max_num_batched_tokens=512).plan()
    assert seg_ctx is not None and seg_ctx.ctx0.tolist() == [512]
    assert seg_ctx.attn0 == pytest.approx(512 * (256 + 512))


def test_segment_jumps_over_identical_steps() -> None:
    # three decoders with 10, 4 and 7 tokens left: first change after 4 steps
    w = wl([10, 10, 10], [10, 10, 10], [1, 1, 1], [11, 5, 8])
    seg = w.plan()
    assert seg is not None and seg.steps == 4 and seg.n_decode == 3
    done = w.apply(seg)
    assert done.finished.tolist() == [1]
    assert w.decoded.tolist() == [5, 5, 5]


def test_steps_within_is_the_inverse_of_total_ms() -> None:
    # decoders whose steps grow with context: the most whole steps that fit in a span
    from routing.steptime import StepTimeModel

    model = StepTimeModel(
        c0_ms=5.0, c1_ms_per_token=0.1, c2_ms_per_ctx_token=0.01, c3_ms_per_attn_unit=0.0
    )
    seg = wl([10, 10, 10], [10, 10, 10], [1, 1, 1], [41, 41, 41]).plan()
    assert seg is not None and seg.steps == 40
    for m in range(seg.steps + 1):
        total = seg.total_ms(model, m)
        assert seg.steps_within(model, total) == m
        if m < seg.steps:
            assert seg.steps_within(model, (total + seg.total_ms(model, m + 1)) / 2) == m
    assert seg.steps_within(model, 0.0) == 0
    assert seg.steps_within(model, 1e9) == seg.steps


def test_partial_application_of_a_segment() -> None:
    w = wl([10], [10], [1], [11])
    seg = w.plan()
    assert seg is not None and seg.steps == 10
    done = w.apply(seg, 3)
    assert done.finished.size == 0 and w.decoded[0] == 4
    with pytest.raises(ValueError, match="steps must be in"):
        w.apply(seg, 11)


def test_preemption_by_recompute_when_kv_blocks_run_out() -> None:
    # block size 4, 6 blocks: two decoders with 12 cached tokens (3 blocks each) need a 4th
    # block on the next step: the later one is preempted and re-queued; it will re-prefill
    # its prompt plus its 5 generated tokens, then produce the 5 it still owes
    w = wl([8, 8], [8, 8], [5, 5], [10, 10], kv_blocks=6, block_size_tokens=4)
    seg = w.plan()
    assert seg is not None and seg.preempted
    assert seg.rows.tolist() == [0]  # no admission in a step that preempted
    assert w.prefilled[1] == 0 and w.prompt[1] == 13 and w.output[1] == 5


def test_sarathi_schedules_decodes_before_prefill_chunks() -> None:
    # row 0 is mid-prefill, row 1 decoding; chunk 64
    kw = {"policy": "sarathi", "chunk_size_tokens": 64}
    w = wl([1000, 10], [100, 10], [0, 1], [5, 5], **kw)
    seg = w.plan()
    assert seg is not None
    assert dict(zip(seg.rows.tolist(), seg.tokens.tolist(), strict=True)) == {1: 1, 0: 63}
    # vLLM V1 takes running requests in order: the prefill eats the whole budget
    w1 = wl([1000, 10], [100, 10], [0, 1], [5, 5], max_num_batched_tokens=64)
    seg1 = w1.plan()
    assert seg1 is not None
    assert dict(zip(seg1.rows.tolist(), seg1.tokens.tolist(), strict=True)) == {0: 64}


def test_vllm_v0_runs_prefills_first_without_chunking() -> None:
    w = wl([10, 700], [10, 0], [1, 0], [9, 2], policy="vllm-v0", max_num_batched_tokens=512)
    seg = w.plan()
    assert seg is not None and seg.n_prefill == 1 and seg.n_decode == 0
    assert seg.tokens.tolist() == [700]  # a lone prompt longer than the budget runs whole
    w.apply(seg)
    seg = w.plan()
    assert seg is not None and seg.n_decode == 2 and seg.n_prefill == 0


def test_max_num_seqs_holds_requests_back() -> None:
    w = wl([10, 10, 10], [0, 0, 0], [0, 0, 0], [2, 2, 2], max_num_seqs=2)
    seg = w.plan()
    assert seg is not None and seg.rows.tolist() == [0, 1] and seg.n_waiting == 1


def test_shared_prefix_is_a_cache_hit_at_admission() -> None:
    w = wl([1000], [0], [0], [2], shared_prefix_tokens=600)
    seg = w.plan()
    assert seg is not None and seg.tokens.tolist() == [400]
    assert seg.start_prefilled.tolist() == [600] and seg.ctx0.tolist() == [600]
    # vLLM always recomputes the last prompt token
    w2 = wl([100], [0], [0], [2], shared_prefix_tokens=600)
    seg2 = w2.plan()
    assert seg2 is not None and seg2.tokens.tolist() == [1]


def test_a_request_larger_than_the_kv_cache_is_refused_and_outputs_stop_at_the_cache() -> None:
    with pytest.raises(SchedulingError, match="prompt of 1000 tokens .* KV cache of 160 tokens"):
        wl([1000], [0], [0], [2], kv_blocks=10, block_size_tokens=16, max_num_batched_tokens=1000)
    w = wl([100], [0], [0], [2], kv_blocks=10, block_size_tokens=16, max_num_batched_tokens=1000)
    with pytest.raises(SchedulingError, match="prompt of 160 tokens"):
        w.append(np.array([160]), np.array([5]))
    # 159 + 100 > 160: the output stops where the cache is full (vLLM: finish_reason length)
    w.append(np.array([150]), np.array([100]))
    assert w.output.tolist() == [2, 10]
