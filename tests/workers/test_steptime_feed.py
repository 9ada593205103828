"""workers.steptime_feed: what a worker observes becomes Eq. 9 rows (pure, no I/O)."""

from __future__ import annotations

import numpy as np
import pytest

from routing.recalibration import decode_row, ttft_row
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig
from workers.steptime_feed import StepTimeFeed, StepTimeFeedConfig, dispatch_estimate_ms

PRIOR = StepTimeModel(8.0, 0.05, 0.0005, 1e-6)
SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)


def test_a_ttft_row_holds_the_requests_in_flight_when_it_was_sent() -> None:
    feed = StepTimeFeed(PRIOR, SCHED)
    feed.sent("a", 300, 50, 0.0)
    feed.progress("a", 1, 0.1)  # a decodes
    feed.progress("a", 3, 0.12)
    feed.sent("b", 500, 40, 0.2, predicted_ttft_ms=100.0, decided_at=0.15)
    feed.finished("b", engine_ttft_ms=120.0, first_token_at=0.32)
    X, y = feed.refitter.rows()
    ahead = InstanceState(np.array([300]), np.array([300]), np.array([3]), np.array([50]))
    assert y.tolist() == [120.0]
    assert X[0] == pytest.approx(ttft_row(ahead, 500, SCHED))
    # the router predicted 100 ms at decision time; it took 170 ms from then
    assert feed.ttft_error("router") == pytest.approx(70.0 / 170.0)
    assert feed.ttft_error("refit") == pytest.approx(abs(X[0] @ PRIOR.coef - 120.0) / 120.0)


def test_decode_rows_only_while_everything_in_flight_decodes() -> None:
    feed = StepTimeFeed(PRIOR, SCHED, StepTimeFeedConfig(decode_row_tokens=4))
    feed.sent("a", 100, 50, 0.0)
    feed.sent("b", 200, 50, 0.0)
    feed.progress("a", 1, 0.05)
    feed.progress("a", 5, 0.09)  # b has not started decoding: no row
    feed.progress("b", 1, 0.10)  # b's first token changes the batch: the anchor restarts
    feed.progress("a", 6, 0.11)  # the anchor: a at 6 tokens, b at 1
    feed.progress("b", 2, 0.115)  # (not the oldest: never a row of its own)
    feed.progress("a", 10, 0.15)  # 4 steps of two decodes
    assert feed.rows["decode"] == 1
    X, y = feed.refitter.rows()
    assert X[-1] == pytest.approx(decode_row([100 + 6, 200 + 1], 4))
    assert y[-1] == pytest.approx(40.0)
    feed.sent("c", 50, 10, 0.16)  # a new request: no row across it
    feed.progress("a", 20, 0.3)
    assert feed.rows["decode"] == 1


def test_rows_stop_while_the_engine_runs_other_clients_requests() -> None:
    feed = StepTimeFeed(PRIOR, SCHED)
    feed.sent("a", 100, 10, 0.0)
    feed.engine_counts(running=4, waiting=1)  # the engine has 5, the worker 1
    feed.finished("a", engine_ttft_ms=30.0, first_token_at=0.03)
    assert feed.rows == {"ttft": 0, "decode": 0, "skipped": 1}
    feed.engine_counts(running=1, waiting=0)
    feed.sent("b", 100, 10, 0.1)
    feed.finished("b", engine_ttft_ms=30.0, first_token_at=0.13)
    assert feed.rows["ttft"] == 1


def test_failed_and_implausible_requests_give_no_row() -> None:
    feed = StepTimeFeed(PRIOR, SCHED)
    feed.sent("a", 100, 10, 0.0)
    feed.finished("a", engine_ttft_ms=None, first_token_at=None)  # an engine error
    feed.sent("b", 1000, 10, 0.0)
    feed.finished("b", engine_ttft_ms=0.1, first_token_at=0.0001)  # 4 steps in 0.1 ms
    feed.finished("never-sent", engine_ttft_ms=10.0, first_token_at=1.0)
    assert feed.rows == {"ttft": 0, "decode": 0, "skipped": 1}
    assert feed.refitter.n_rows == 0 and feed.ttft_error("router") is None
    with pytest.raises(ValueError, match="decode_row_tokens"):
        StepTimeFeedConfig(decode_row_tokens=0)


def test_the_engines_own_prompt_count_wins_for_the_row() -> None:
    feed = StepTimeFeed(PRIOR, SCHED)
    feed.sent("a", 100, 10, 0.0)  # the worker's estimate (bytes / 4)
    feed.finished("a", engine_ttft_ms=300.0, first_token_at=0.3, prompt_tokens=320)  # usage
    X, _ = feed.refitter.rows()
    assert X[0] == pytest.approx(ttft_row(InstanceState.empty(), 320, SCHED))


def test_dispatch_estimate_is_the_median_of_finite_samples() -> None:
    assert dispatch_estimate_ms([]) is None
    assert dispatch_estimate_ms([float("nan")]) is None
    # one re-delivered query's 30 s does not move it
    assert dispatch_estimate_ms([12.0, 30_000.0, 8.0, 10.0, float("inf")]) == pytest.approx(11.0)


def test_the_feed_keeps_each_requests_decision_to_engine_delay() -> None:
    feed = StepTimeFeed(PRIOR, SCHED, StepTimeFeedConfig(error_window=3, max_dispatch_ms=1000.0))
    assert feed.dispatch_ms() is None
    feed.sent("a", 100, 10, 10.020, decided_at=10.0)  # 20 ms
    feed.sent("b", 100, 10, 10.1)  # no decision time: no sample
    feed.sent("c", 100, 10, 10.040, decided_at=10.0)  # 40 ms
    feed.sent("d", 100, 10, 12.0, decided_at=10.0)  # 2 s: beyond max_dispatch_ms, dropped
    feed.sent("e", 100, 10, 9.9, decided_at=10.0)  # before the decision (skewed clock)
    assert feed.dispatch_ms() == pytest.approx(30.0)
    for k in range(3):  # the window keeps the last error_window samples
        feed.sent(f"f{k}", 100, 10, 20.005, decided_at=20.0)
    assert feed.dispatch_ms() == pytest.approx(5.0)


def test_a_wait_for_a_worker_slot_is_load_not_dispatch() -> None:
    feed = StepTimeFeed(PRIOR, SCHED, StepTimeFeedConfig(error_window=8))
    # decided at 10.0, received at 10.015, waited 0.5 s for a slot, sent at 10.525
    feed.sent("a", 100, 10, 10.525, decided_at=10.0, slot_wait_s=0.5)
    assert feed.dispatch_ms() == pytest.approx(25.0)
    feed.sent("b", 100, 10, 20.030, decided_at=20.0)  # no wait: all of it is dispatch
    feed.sent("c", 100, 10, 30.035, decided_at=30.0, slot_wait_s=0.0)
    assert feed.dispatch_ms() == pytest.approx(30.0)


def test_lone_requests_measure_the_servers_own_time_published_with_the_dispatch() -> None:
    feed = StepTimeFeed(PRIOR, SCHED, StepTimeFeedConfig(error_window=8))
    assert feed.server_ms() is None
    lone = float(PRIOR.prefill_ms(200))
    for k, extra in enumerate((6.0, 8.0, 7.0)):  # each alone on the engine
        feed.sent(f"a{k}", 200, 10, 100.0 + k)
        feed.finished(f"a{k}", lone + extra, 100.0 + k + 0.01)
    feed.sent("b", 200, 10, 200.0)  # not alone: "c" joins while it is in flight
    feed.sent("c", 200, 10, 200.001)
    feed.finished("c", lone + 500.0, 200.6)
    feed.finished("b", lone + 500.0, 200.6)
    assert feed.server_ms() == pytest.approx(7.0)
    assert feed.dispatch_ms() == pytest.approx(7.0)  # no dispatch sample yet: the server's
    feed.sent("d", 200, 10, 300.020, decided_at=300.0)
    assert feed.dispatch_ms() == pytest.approx(20.0 + 7.0)
