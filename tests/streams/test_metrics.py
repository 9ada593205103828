"""``streams.metrics.observe_many``: the same histogram as one ``observe`` per amount."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram

from streams.metrics import _LATENCY_BUCKETS, observe_many


def _samples(h: Histogram) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value for metric in h.collect() for s in metric.samples
        if not s.name.endswith("_created")
    }  # fmt: skip


def test_observe_many_equals_observe_one_by_one() -> None:
    amounts = [0.0, 0.005, 0.0050001, 0.049, 0.05, 0.3, 2.5, 9.99, 10.0, 10.5, 1e9]
    amounts += [i * 0.0137 for i in range(500)]
    one = Histogram("one", "", buckets=_LATENCY_BUCKETS, registry=CollectorRegistry())
    many = Histogram("many", "", buckets=_LATENCY_BUCKETS, registry=CollectorRegistry())
    for a in amounts:
        one.observe(a)
    observe_many(many, amounts[:7])
    observe_many(many, [])
    observe_many(many, amounts[7:])
    got = {(k[0].replace("many", "one"), k[1]): v for k, v in _samples(many).items()}
    want = _samples(one)
    assert got.keys() == want.keys()
    for k, v in want.items():
        if k[0] == "one_sum":
            assert got[k] == v or math.isclose(got[k], v, rel_tol=1e-12)
        else:
            assert got[k] == v, k


def test_observe_many_on_a_labelled_child_and_a_nan() -> None:
    reg = CollectorRegistry()
    h = Histogram("h", "", ["x"], buckets=(1.0, 2.0), registry=reg)
    ref = Histogram("r", "", ["x"], buckets=(1.0, 2.0), registry=CollectorRegistry())
    observe_many(h.labels("a"), [0.5, 1.5, 3.0, math.nan, math.inf])
    for a in (0.5, 1.5, 3.0, math.nan, math.inf):
        ref.labels("a").observe(a)
    got = {(k[0][1:], k[1]): v for k, v in _samples(h).items() if not k[0].endswith("_sum")}
    want = {(k[0][1:], k[1]): v for k, v in _samples(ref).items() if not k[0].endswith("_sum")}
    assert got == want
