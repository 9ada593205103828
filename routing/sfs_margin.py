"""A calibrated TTFT margin for SLO checks (issue 13): constrain a high quantile of the
predicted TTFT rather than its point value.

SFS predicts TTFT from the instance's state at decision time; the realised TTFT also
depends on arrivals after the decision (they join the same batches), on preemptions
and on step-time noise. Given pairs of predicted and observed TTFT (from a simulator
run, or from the decision audit and the results of a running service), the margin

    m = quantile_q( observed / predicted )

makes ``m · L̂ <= τ`` a check that holds for a share ``q`` of the queries it admits, if
the error distribution of the calibration run carries over. A policy then compares
``L̂`` with ``τ / m``.
"""

from __future__ import annotations

import math

import numpy as np

from routing.types import FloatArray


def ttft_margin(
    predicted_ms: FloatArray, observed_ms: FloatArray, quantile: float = 0.9, min_pairs: int = 50
) -> float:
    """``quantile`` of observed/predicted TTFT over the pairs with both values finite and
    a predicted TTFT above 1 ms; 1.0 (no margin) with fewer than ``min_pairs`` pairs."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    p = np.asarray(predicted_ms, dtype=np.float64)
    o = np.asarray(observed_ms, dtype=np.float64)
    if p.shape != o.shape:
        raise ValueError(f"predicted and observed TTFT differ in shape: {p.shape} vs {o.shape}")
    ok = np.isfinite(p) & np.isfinite(o) & (p > 1.0) & (o >= 0)
    if int(ok.sum()) < min_pairs:
        return 1.0
    m = float(np.quantile(o[ok] / p[ok], quantile))
    return m if math.isfinite(m) and m > 0 else 1.0
