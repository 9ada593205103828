"""Arrival processes, trace replay, SLO sampling and adversarial ordering (sim/traffic.py)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from sim.traffic import (
    MMPPSpec,
    SloSpec,
    TrafficError,
    adversarial_order,
    build_workload,
    load_servegen,
    load_trace,
    mmpp_arrivals,
    poisson_arrivals,
    resolve_trace,
    scale_rate,
    servegen_arrivals,
)
from wiring.paths import shared_data


def test_poisson_rate_and_determinism() -> None:
    a = poisson_arrivals(20.0, 500.0, np.random.default_rng(1))
    b = poisson_arrivals(20.0, 500.0, np.random.default_rng(1))
    assert np.array_equal(a, b)
    # count ~ Poisson(10000): 5 sigma = 500
    assert abs(a.size - 10_000) < 500
    assert (np.diff(a) >= 0).all() and a.min() >= 0 and a.max() < 500
    iat = np.diff(a)
    assert abs(iat.std() / iat.mean() - 1.0) < 0.05  # exponential: CV = 1


def test_mmpp_matches_configuration_statistically() -> None:
    spec = MMPPSpec(rates_per_s=(5.0, 40.0), mean_dwell_s=(30.0, 10.0))
    # stationary share: 30/(30+10) in calm, 10/40 in burst -> mean rate 0.75*5 + 0.25*40 = 13.75
    assert spec.mean_rate_per_s == pytest.approx(13.75)
    t, s = mmpp_arrivals(spec, 20_000.0, np.random.default_rng(7))
    assert abs(t.size / 20_000.0 - 13.75) / 13.75 < 0.05
    # arrivals in each state at that state's rate: rate_k = count_k / time_k,
    # with time_k estimated from the stationary share
    share = spec.stationary()
    for k, rate in enumerate(spec.rates_per_s):
        est = (s == k).sum() / (share[k] * 20_000.0)
        assert abs(est - rate) / rate < 0.1
    # bursty: the index of dispersion of counts in 10 s bins is far above Poisson's 1
    counts = np.bincount((t // 10).astype(int))
    assert counts.var() / counts.mean() > 5


def test_mmpp_three_states_and_bursty_constructor() -> None:
    spec = MMPPSpec(
        (1.0, 10.0, 50.0), (60.0, 20.0, 5.0), ((0, 0.9, 0.1), (0.8, 0, 0.2), (0.5, 0.5, 0))
    )
    t, s = mmpp_arrivals(spec, 30_000.0, np.random.default_rng(3))
    assert set(np.unique(s).tolist()) == {0, 1, 2}
    assert abs(t.size / 30_000.0 - spec.mean_rate_per_s) / spec.mean_rate_per_s < 0.07
    b = MMPPSpec.bursty(8.0, burst_ratio=5.0, burst_share=0.25)
    assert b.mean_rate_per_s == pytest.approx(8.0)
    assert b.rates_per_s[1] == pytest.approx(5 * b.rates_per_s[0])
    assert b.scaled(2.0).mean_rate_per_s == pytest.approx(16.0)


def test_bad_parameters_say_what_is_wrong() -> None:
    with pytest.raises(TrafficError, match="at least 2 states"):
        MMPPSpec((1.0,), (1.0,))
    with pytest.raises(TrafficError, match="mean_dwell_s\\[1\\]"):
        MMPPSpec((1.0, 2.0), (1.0, -1.0))
    with pytest.raises(TrafficError, match="rate_per_s"):
        poisson_arrivals(0.0, 10.0, np.random.default_rng(0))
    with pytest.raises(TrafficError, match="rate_scale"):
        scale_rate(np.zeros(3), -1.0)
    with pytest.raises(TrafficError, match="uniform takes 2"):
        SloSpec.parse("uniform:5")
    with pytest.raises(TrafficError, match="unknown SLO kind"):
        SloSpec.parse("gauss:1,2")


def test_slo_spec_sampling() -> None:
    rng = np.random.default_rng(0)
    assert (SloSpec.parse("fixed:2000").sample(5, rng) == 2000).all()
    u = SloSpec.parse("uniform:500,5000").sample(10_000, rng)
    assert u.min() >= 500 and u.max() <= 5000 and abs(u.mean() - 2750) < 60
    ln = SloSpec.parse("lognormal:2000,0.5").sample(20_000, rng)
    assert abs(np.median(ln) - 2000) < 60
    c = SloSpec.parse("choice:500,2000,8000").sample(3000, rng)
    assert set(np.unique(c).tolist()) == {500.0, 2000.0, 8000.0}
    assert str(SloSpec.parse("choice:500,2000")) == "choice:500,2000"


def test_trace_load_window_scale(tmp_path: Path) -> None:
    p = tmp_path / "t.csv.gz"
    with gzip.open(p, "wt") as fh:
        fh.write("arrival_s,input_tokens,output_tokens\n5.0,100,10\n6.0,200,20\n9.0,300,30\n")
    tr = load_trace(p)
    assert tr.arrival_s.tolist() == [0.0, 1.0, 4.0]
    assert tr.input_tokens.tolist() == [100, 200, 300]
    assert tr.scaled(2.0).arrival_s.tolist() == [0.0, 0.5, 2.0]
    assert tr.window(0.5, 2.0).arrival_s.tolist() == [0.5]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_tokens\n1,2\n")
    with pytest.raises(TrafficError, match="missing column"):
        load_trace(bad)
    bad.write_text("arrival_s,input_tokens,output_tokens\n1,x,2\n")
    with pytest.raises(TrafficError, match="line 2: input_tokens"):
        load_trace(bad)


def test_adversarial_order_bunches_hard_queries() -> None:
    rng = np.random.default_rng(0)
    h = rng.random(1000)
    order = adversarial_order(h, 50, rng)
    assert sorted(order.tolist()) == list(range(1000))
    batches = h[order].reshape(20, 50)
    # within-batch spread is tiny compared with random batches
    assert batches.std(axis=1).mean() < 0.05
    means = batches.mean(axis=1)
    assert means.max() > 0.95 and means.min() < 0.05
    assert not np.all(np.diff(means) < 0)  # batch order is shuffled, not sorted


def _toy_data(n: int = 40, m: int = 3) -> dict[str, object]:
    rng = np.random.default_rng(5)
    out = np.full((n, m), np.nan)
    out[:, 0] = 50.0
    return {
        "scores": rng.random((n, m)),
        "texts": [f"q{i}" for i in range(n)],
        "tasks": ["t"] * n,
        "models": ["a", "b", "c"],
        "data_prompt_tokens": np.arange(1, n + 1),
        "data_output_tokens": out,
    }


def test_build_workload_joins_arrivals_to_queries() -> None:
    d = _toy_data()
    arr = np.array([0.0, 0.5, 1.0, 1.5])
    w = build_workload(
        arr,
        slo=SloSpec.parse("fixed:1000"),
        rng=np.random.default_rng(0),
        rows=np.array([3, 3, 7, 0]),
        default_output_tokens=100.0,
        **d,
    )  # type: ignore[arg-type]
    assert w.n == 4 and w.prompt_tokens.tolist() == [4, 4, 8, 1]
    assert w.output_tokens[:, 0].tolist() == [50] * 4 and (w.output_tokens[:, 1:] == 100).all()
    assert np.array_equal(w.scores[0], np.asarray(d["scores"])[3])
    q = w.query(2)
    assert (
        q.id == w.query_id(2)
        and q.prompt_tokens == 8
        and q.ttft_slo_ms == 1000
        and q.created_at == 1.0
    )
    # trace token counts win, and keep the models' relative lengths
    w2 = build_workload(
        arr,
        slo=SloSpec.parse("fixed:1000"),
        rng=np.random.default_rng(0),
        rows=np.array([3, 3, 7, 0]),
        default_output_tokens=100.0,
        trace_input_tokens=np.array([900, 800, 700, 600]),
        trace_output_tokens=np.array([250, 250, 250, 250]),
        **d,
    )  # type: ignore[arg-type]
    assert w2.prompt_tokens.tolist() == [900, 800, 700, 600]
    assert w2.output_tokens[0, 0] < w2.output_tokens[0, 1]
    assert abs(w2.output_tokens[0].mean() - 250) <= 1


@pytest.mark.shared_data
def test_real_traces_and_servegen_load() -> None:
    conv = resolve_trace("azure-conv", shared_data("traces"))
    if not conv.exists():
        pytest.skip("../shared traces not present")
    tr = load_trace(conv)
    assert tr.n == 19_366 and 5.0 < tr.mean_rate_per_s < 6.0
    sg_path = shared_data("traces", "servegen", "servegen_client_windows.csv.gz")
    win = load_servegen(sg_path, "language", "m-small")
    t = servegen_arrivals(win, 0.0, 1200.0, np.random.default_rng(0))
    sel = (win.window_start_s < 1200.0) & (win.window_start_s + 600 > 0.0)
    expect = float((win.rate_per_s[sel] * 600.0).sum())
    assert (np.diff(t) >= 0).all() and t.max() < 1200.0
    assert abs(t.size - expect) / expect < 0.25  # heavy-tailed IATs: loose
