"""workers.pacing: a cloud endpoint's rate limit, kept by the rule the simulator keeps."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from routing.steptime import StepTimeModel
from schemas import ModelSpec
from sim.cluster import CloudEndpoint
from workers.pacing import AdmissionPacer


def test_admissions_follow_the_simulated_cloud_endpoints_rule() -> None:
    """Bursts and quiet spells: each admission the pacer grants is the simulator's start."""
    now = [0.0]
    pacer = AdmissionPacer(4.0, clock=lambda: now[0])
    step = StepTimeModel(c0_ms=1.0, c1_ms_per_token=0.0, c2_ms_per_ctx_token=0.0,
                         c3_ms_per_attn_unit=0.0)  # fmt: skip
    sim = CloudEndpoint("c-0", "c", step, max_concurrency=1000, rate_limit_rps=4.0,
                        network_ms=0.0, noise_sigma=0.0)  # fmt: skip
    arrivals = [0.0, 0.0, 0.0, 0.1, 0.9, 3.0, 3.01, 3.02]
    admitted = []
    for k, t in enumerate(arrivals):
        now[0] = t
        admitted.append(t + pacer.reserve())
        done = sim.serve(f"q{k}", t, t, 1, 1)
        assert admitted[-1] == pytest.approx(done.first_token_s - float(step.prefill_ms(1)) / 1e3)
    # a burst goes out 0.25 s apart; a quiet spell saves no burst
    assert admitted == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 3.0, 3.25, 3.5])


async def test_concurrent_waiters_are_spaced_by_the_interval() -> None:
    pacer = AdmissionPacer(20.0)
    loop = asyncio.get_running_loop()
    times: list[float] = []

    async def one() -> None:
        await pacer.wait()
        times.append(loop.time())

    await asyncio.gather(*(one() for _ in range(6)))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(gap >= 0.045 for gap in gaps), gaps
    assert times[-1] - times[0] < 0.5


def test_bad_rates_and_a_local_models_limit_are_refused() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate_per_s must be a finite number > 0"):
            AdmissionPacer(bad)
    with pytest.raises(ValidationError, match="rate_limit_rps is for kind: cloud"):
        ModelSpec(name="m", input_usd_per_token=0, output_usd_per_token=0, rate_limit_rps=5)
    ModelSpec(name="m", kind="cloud", input_usd_per_token=0, output_usd_per_token=0,
              rate_limit_rps=5)  # fmt: skip
