"""Online Eq. 9 refit (routing.recalibration): rows, prior, outliers, convergence."""

from __future__ import annotations

import numpy as np
import pytest

from loaders.profiles import load_profile
from routing.recalibration import OnlineRefit, RefitConfig, decode_row, fit_with_prior, ttft_row
from routing.sfs import estimate_ttft_ms
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig
from sim.engine import SimEngine
from sim.timing import LinearTiming

# a CPU-like engine (the shape of configs/clusters/real-vllm-cpu.yaml), far from any H100
TRUE = StepTimeModel(9.0, 0.06, 0.0008, 2.0e-6)
SCHED = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_blocks=16384)
WRONG = load_profile("llama-2-7b-hf@h100")


def _state(rows: list[tuple[int, int, int, int]]) -> InstanceState:
    a = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return InstanceState(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def test_ttft_row_is_sfs_linear_in_the_coefficients() -> None:
    st = _state([(300, 300, 20, 80), (900, 400, 0, 50), (120, 0, 0, 30)])
    row = ttft_row(st, 700, SCHED)
    want = estimate_ttft_ms(st, np.array([700]), TRUE, SCHED)[0]
    assert row @ TRUE.coef == pytest.approx(want, rel=1e-9)
    assert row[0] >= 2  # the 700-token prompt needs more than one 512-token step
    lone = ttft_row(InstanceState.empty(), 200, SCHED)
    assert lone @ TRUE.coef == pytest.approx(float(TRUE.prefill_ms(200)), rel=1e-9)


def test_decode_row_sums_steps_with_growing_contexts() -> None:
    row = decode_row([100, 250], 3)
    per_step = [TRUE.step_ms(2, 350 + 2 * j, 0.0) for j in range(3)]
    assert row @ TRUE.coef == pytest.approx(float(np.sum(per_step)))
    with pytest.raises(ValueError, match="at least one decode"):
        decode_row([], 3)


def _observations(n_requests: int, seed: int, noise: float = 0.03) -> tuple[np.ndarray, np.ndarray]:
    """Rows a worker would record on a simulated engine priced by ``TRUE``: at each send the
    residents it knows (predicted lengths), and the TTFT it measures."""
    rng = np.random.default_rng(seed)
    eng = SimEngine(LinearTiming(TRUE, noise), SCHED, seed)
    t, rows, sent = 0.0, {}, {}
    X, y = [], []
    for i in range(n_requests):
        t += rng.exponential(0.35)
        for ev in eng.advance_to(t):
            if ev.kind == "first_token" and ev.request_id in rows:
                X.append(rows.pop(ev.request_id))
                y.append((ev.t_s - sent.pop(ev.request_id)) * 1000.0)
        prompt = int(rng.integers(20, 1500))
        out = int(rng.integers(10, 200))
        rid = f"r{i}"
        rows[rid] = ttft_row(eng.snapshot(), prompt, SCHED)
        sent[rid] = t
        eng.submit(rid, t, prompt, out, predicted_output_tokens=100)
    return np.array(X), np.array(y)


def test_refit_from_the_wrong_profile_converges_on_recorded_observations() -> None:
    X, y = _observations(600, seed=1)
    hold_X, hold_y = _observations(300, seed=2)
    refit = OnlineRefit(WRONG)
    errs = []
    for i, (row, t_ms) in enumerate(zip(X, y, strict=True)):
        refit.add(row, float(t_ms))
        if (i + 1) % 100 == 0:
            m = refit.refit().model
            errs.append(float(np.mean(np.abs(hold_X @ m.coef - hold_y) / hold_y)))
    true_err = float(np.mean(np.abs(hold_X @ TRUE.coef - hold_y) / hold_y))
    wrong_err = float(np.mean(np.abs(hold_X @ WRONG.coef - hold_y) / hold_y))
    assert wrong_err > 0.3  # the H100 profile is far off on this engine
    assert errs[-1] < true_err + 0.02  # within 2 points of the true coefficients
    assert errs[0] < wrong_err / 3  # 100 observations already fix most of it
    # the dense-layer cost is recovered; c0 comes out above the truth, as it absorbs what
    # the rows do not model (the step in flight at send time: half a step on average)
    got = refit.model
    assert got.c1_ms_per_token == pytest.approx(TRUE.c1_ms_per_token, rel=0.25)
    assert got.c0_ms > TRUE.c0_ms


def test_outliers_are_bounded() -> None:
    X, y = _observations(400, seed=3, noise=0.0)
    y = y.copy()
    y[::20] *= 20.0  # one in twenty observations stalled (a GC pause, a slow client)
    y[10::20] /= 10.0  # and one in twenty far faster (a prefix-cache hit nobody knew of)
    refit = OnlineRefit(WRONG)
    for row, t_ms in zip(X, y, strict=True):
        refit.add(row, float(t_ms))
    m = refit.refit().model
    clean = np.ones(y.size, dtype=bool)
    clean[::10] = False

    def err(coef: np.ndarray) -> float:
        return float(np.mean(np.abs(X[clean] @ coef - y[clean]) / y[clean]))

    reference = fit_with_prior(X[clean], y[clean], WRONG.coef)  # never saw the stalls
    plain = fit_with_prior(X, y, WRONG.coef, RefitConfig(huber_delta=1e9, prior_rows=0))
    assert err(m.coef) < err(reference.copy()) + 0.02  # the stalls barely move the Huber fit
    assert err(plain) > err(m.coef) + 0.1  # and would have ruined a plain least squares


def test_few_observations_stay_near_the_prior() -> None:
    prior = StepTimeModel(8.0, 0.05, 0.0005, 1e-6)
    refit = OnlineRefit(prior, RefitConfig(min_rows=8, prior_rows=16))
    X, y = _observations(40, seed=4)
    for row, t_ms in zip(X[:5], y[:5], strict=True):
        refit.add(row, float(t_ms))
    assert refit.refit().model == prior  # below min_rows: the prior as it is
    for row, t_ms in zip(X[5:10], y[5:10], strict=True):
        refit.add(row, float(t_ms) * 3.0)  # ten observations, all 3x slower
    m = refit.refit().model
    # moved towards the data, but the 16-row prior holds it well short of 3x
    ratio = float(np.mean((X[:10] @ m.coef) / (X[:10] @ prior.coef)))
    assert 1.05 < ratio < 2.6


def test_unexercised_coefficients_stay_at_the_prior() -> None:
    refit = OnlineRefit(WRONG)
    rng = np.random.default_rng(0)
    for _ in range(50):  # decode rows only: no prefill attention ever seen
        ctx = rng.integers(50, 2000, size=int(rng.integers(1, 9)))
        row = decode_row(ctx, 8)
        refit.add(row, float(row @ TRUE.coef))
    fit = refit.refit()
    assert fit.model.c3_ms_per_attn_unit == WRONG.c3_ms_per_attn_unit
    assert fit.mape < fit.prior_mape / 5


def test_bad_rows_are_refused_and_the_window_is_bounded() -> None:
    refit = OnlineRefit(WRONG, RefitConfig(window_rows=16))
    assert not refit.add([1.0, 2.0, 3.0], 5.0)
    assert not refit.add([1.0, 2.0, 3.0, float("nan")], 5.0)
    assert not refit.add([1.0, 2.0, 3.0, 4.0], 0.0)
    assert not refit.add([0.0, 2.0, 3.0, 4.0], 5.0)  # no step at all
    assert refit.rejected == 4
    for i in range(40):
        assert refit.add([1.0, float(i), 0.0, 0.0], 10.0 + i)
    X, y = refit.rows()
    assert refit.n_rows == 16 and X[0, 1] == 24.0 and y[-1] == 49.0
    with pytest.raises(ValueError, match="window_rows"):
        RefitConfig(window_rows=2)
