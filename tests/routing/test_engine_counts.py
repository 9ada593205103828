"""The engine's /metrics counts reconciled with the worker's resident list (issue 18)."""

from __future__ import annotations

import numpy as np

from routing.engine_counts import DEFAULT_PROMPT_TOKENS, reconcile_engine_counts
from routing.sfs import estimate_ttft_ms
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig


def listed() -> InstanceState:
    """Two running (one decoding, one part-way through its prefill), one waiting."""
    return InstanceState(
        np.array([300, 500, 100]), np.array([300, 200, 0]), np.array([5, 0, 0]),
        np.array([50, 150, 100]),
    )  # fmt: skip


def test_the_view_holds_the_larger_of_the_two_counts() -> None:
    s = listed()
    same = reconcile_engine_counts(s, 1, 0)  # the engine reports fewer: the list stands
    assert same is s
    assert reconcile_engine_counts(s, None, None) is s
    more = reconcile_engine_counts(s, engine_running=4, engine_waiting=3)
    running = int((more.prefilled_tokens > 0).sum())
    assert (running, more.n - running) == (4, 3)
    np.testing.assert_array_equal(more.prompt_tokens[:3], s.prompt_tokens)  # listed rows kept
    # added rows: the listed mean prompt (300) and predicted output (100)
    np.testing.assert_array_equal(more.prompt_tokens[3:], [300] * 4)
    np.testing.assert_array_equal(more.prefilled_tokens[3:], [300, 300, 0, 0])
    np.testing.assert_array_equal(more.decoded_tokens[3:], [1, 1, 0, 0])
    np.testing.assert_array_equal(more.predicted_output_tokens[3:], [100] * 4)


def test_the_engine_kv_usage_sizes_the_running_rows_it_adds() -> None:
    s = listed()  # listed rows hold 300 + 5 + 200 = 505 tokens
    more = reconcile_engine_counts(s, 4, 1, engine_kv_usage=0.25, kv_capacity_tokens=10_000)
    # 2,500 tokens in use, 1,995 of them unlisted, over the 2 added running rows
    np.testing.assert_array_equal(more.prefilled_tokens[3:], [998, 998])
    np.testing.assert_array_equal(more.prompt_tokens[3:], [998, 998])
    capped = reconcile_engine_counts(
        s, 3, 1, engine_kv_usage=0.9, kv_capacity_tokens=10_000, max_model_len=2048
    )
    assert int(capped.prompt_tokens[3]) == 2048
    # usage below what the list holds (shared prefix blocks): the added row gets 1 token
    low = reconcile_engine_counts(s, 3, 1, engine_kv_usage=0.01, kv_capacity_tokens=10_000)
    assert int(low.prompt_tokens[3]) == 1
    # no added running row: the usage changes nothing
    assert reconcile_engine_counts(s, 2, 1, engine_kv_usage=0.9, kv_capacity_tokens=10_000) is s


def test_an_empty_list_takes_the_defaults_and_the_engine_queue_delays_ttft() -> None:
    e = reconcile_engine_counts(InstanceState.empty(), 0, 5, default_output_tokens=64)
    assert e.n == 5 and (e.prefilled_tokens == 0).all()
    assert (e.prompt_tokens == DEFAULT_PROMPT_TOKENS).all() and (e.predicted_output_tokens == 64).all()
    m, sched = StepTimeModel(5.0, 0.02, 1e-4, 1e-6), SchedulerConfig(max_num_batched_tokens=512)
    prompt, out = np.array([200]), np.array([20])
    alone = estimate_ttft_ms(InstanceState.empty(), prompt, m, sched, out)
    behind = estimate_ttft_ms(e, prompt, m, sched, out)
    assert behind[0] > alone[0] + 4 * 5.0  # five unlisted prompts of 512 go first (FCFS)
