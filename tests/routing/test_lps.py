"""LPS average-case TTFT: known answers from queueing theory and monotonicity."""

from __future__ import annotations

import math

import pytest

from routing.lps import lps_distribution, lps_ttft_ms
from routing.steptime import StepTimeModel
from schemas import SchedulerConfig

M = StepTimeModel(
    c0_ms=5.0, c1_ms_per_token=0.02, c2_ms_per_ctx_token=1e-4, c3_ms_per_attn_unit=1e-6
)
S = SchedulerConfig()


def test_idle_instance_is_just_the_prefill() -> None:
    got = lps_ttft_ms(0.0, 1000, 100, 64, M, S)
    assert got == pytest.approx(5.0 + 0.02 * 1000 + 1e-6 * 1000**2 / 2)


def test_k_equals_one_is_mm1() -> None:
    # with one slot the chain is M/M/1: Lq = rho^2 / (1 - rho)
    P, n_out = 500.0, 50.0
    service_ms = n_out * (5.0 + 0.02 + 1e-4 * (P + n_out / 2)) + 0.02 * P + 1e-6 * P * P / 2
    mu = 1000.0 / service_ms  # per second
    lam = 0.6 * mu
    p, rho, lq = lps_distribution(lam, P, n_out, 1, M)
    assert rho == pytest.approx(0.6)
    assert lq == pytest.approx(0.36 / 0.4)
    assert p[0] == pytest.approx(0.4)


def test_ttft_grows_with_load_and_diverges_at_capacity() -> None:
    rates = [0.1, 1, 2, 4, 8]
    got = [lps_ttft_ms(r, 1000, 200, 64, M, S) for r in rates]
    assert all(b >= a for a, b in zip(got, got[1:], strict=False))
    assert math.isinf(lps_ttft_ms(1e6, 1000, 200, 64, M, S))


def test_more_slots_mean_less_waiting() -> None:
    assert lps_ttft_ms(3, 1000, 200, 8, M, S) <= lps_ttft_ms(3, 1000, 200, 2, M, S)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="arrival_rate_per_s must be a finite number >= 0"):
        lps_ttft_ms(-1, 1, 1, 1, M, S)
    with pytest.raises(ValueError, match="mean_output_tokens must be a finite number >= 1"):
        lps_ttft_ms(1, 1, 0, 1, M, S)
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        lps_ttft_ms(1, 1, 1, 0, M, S)
