"""Step-duration sources for the simulated engine.

The engine must not be priced by the very linear model SFS uses, or validating SFS against
it would be circular. :class:`TableTiming` prices a step from measured tables instead:

* dense layers: Vidur's per-operator H100 timings (sum of one layer's operators x layers +
  embedding), interpolated in the number of batched tokens (piecewise linear, so GEMM
  tile effects and the flat region at small batches are kept);
* CPU overhead per step: Vidur's measured scheduler/sampler/input-preparation times,
  linear in the number of sequences;
* attention (Vidur's attention tables were not obtainable): decode is memory-bound, a
  per-sequence kernel cost plus KV bytes read at a calibrated bandwidth; prefill is a
  calibrated FLOP rate whose efficiency grows with the chunk length
  (``eff(q) = q / (q + q_half)``), which makes small chunks relatively expensive;
* optional multiplicative log-normal noise per step (seeded).

:class:`LinearTiming` prices steps with Eq. 9 itself (optionally with noise): SFS equals
the engine exactly when the engine runs it without noise and with oracle lengths.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from routing.profiles import Profiles, Table
from routing.scheduling import Segment
from routing.steptime import StepTimeModel

FloatArray = npt.NDArray[np.float64]


class TimingSource(Protocol):
    """Prices engine steps."""

    def segment_ms(self, seg: Segment, steps: int, rng: np.random.Generator) -> FloatArray:
        """Durations (ms) of the first ``steps`` steps of ``seg``."""
        ...


def _noise(rng: np.random.Generator, sigma: float, n: int) -> FloatArray | float:
    if sigma <= 0:
        return 1.0
    # mean-one log-normal: exp(N(-s^2/2, s^2))
    return np.asarray(rng.lognormal(-sigma * sigma / 2.0, sigma, n), dtype=np.float64)


@dataclass(frozen=True)
class LinearTiming:
    """Eq. 9 itself, optionally with multiplicative noise."""

    model: StepTimeModel
    noise_sigma: float = 0.0

    def segment_ms(self, seg: Segment, steps: int, rng: np.random.Generator) -> FloatArray:
        base, growth = seg.base_growth_ms(self.model)
        t = base + growth * np.arange(steps, dtype=np.float64)
        return np.asarray(t * _noise(rng, self.noise_sigma, steps), dtype=np.float64)


@dataclass(frozen=True)
class TableTiming:
    """Step time from a profile's measured tables (``routing.profiles.Table``), plus noise.

    Build it with :meth:`from_profile` (or field by field, as ``sim.cluster`` does).
    """

    dense_tokens: tuple[float, ...]
    dense_ms: tuple[float, ...]
    cpu_ms: float
    cpu_ms_per_seq: float
    decode_ms_per_seq: float
    decode_ms_per_ctx_token: float
    prefill_ms_per_attn_unit: float
    prefill_half_eff_tokens: float = 128.0
    noise_sigma: float = 0.0
    table: Table = field(init=False, repr=False, compare=False)
    _xs: list[float] = field(init=False, repr=False, compare=False)
    _ys: list[float] = field(init=False, repr=False, compare=False)
    _slope: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        x = np.asarray(self.dense_tokens, dtype=np.float64)
        y = np.asarray(self.dense_ms, dtype=np.float64)
        if x.size < 2 or x.shape != y.shape or (np.diff(x) <= 0).any():
            raise ValueError("TableTiming: dense_tokens must be increasing and match dense_ms")
        if self.noise_sigma < 0:
            raise ValueError(f"TableTiming: noise_sigma must be >= 0, got {self.noise_sigma}")
        tb = Table(
            x,
            y,
            float(self.cpu_ms),
            float(self.cpu_ms_per_seq),
            float(self.decode_ms_per_seq),
            float(self.decode_ms_per_ctx_token),
            float(self.prefill_ms_per_attn_unit),
            float(self.prefill_half_eff_tokens),
        )
        object.__setattr__(self, "table", tb)
        object.__setattr__(self, "_xs", [float(v) for v in x])
        object.__setattr__(self, "_ys", [float(v) for v in y])
        object.__setattr__(self, "_slope", float(tb.dense(x[-1] + 1.0) - y[-1]))

    def _dense(self, n: float) -> float:
        """``Table.dense`` for one token count, without numpy call overhead."""
        xs, ys = self._xs, self._ys
        if n >= xs[-1]:
            return ys[-1] + self._slope * (n - xs[-1])
        if n <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, n)
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - x0) / (x1 - x0)

    @classmethod
    def from_table(cls, tb: Table, noise_sigma: float = 0.0) -> TableTiming:
        return cls(
            tuple(float(v) for v in tb.dense_tokens),
            tuple(float(v) for v in tb.dense_ms),
            tb.cpu_ms,
            tb.cpu_ms_per_seq,
            tb.decode_ms_per_seq,
            tb.decode_ms_per_ctx_token,
            tb.prefill_ms_per_attn_unit,
            tb.prefill_half_eff_tokens,
            noise_sigma,
        )

    @classmethod
    def from_profile(cls, profiles: Profiles, name: str, noise_sigma: float = 0.0) -> TableTiming:
        """The measured-table timing of profile ``name`` in ``profiles`` (``routing.profiles``;
        ``loaders.profiles.read_profiles`` reads the shipped ones)."""
        return cls.from_table(profiles.table(name), noise_sigma)

    def with_noise(self, sigma: float) -> TableTiming:
        return TableTiming.from_table(self.table, sigma)

    def segment_ms(self, seg: Segment, steps: int, rng: np.random.Generator) -> FloatArray:
        tb = self.table
        j = np.arange(steps, dtype=np.float64)
        const = (
            tb.cpu_ms
            + tb.cpu_ms_per_seq * seg.n_seqs
            + self._dense(float(seg.n_tokens))
            + tb.decode_ms_per_seq * seg.n_decode
            + tb.decode_ms_per_ctx_token * seg.decode_ctx0
        )
        per_j = tb.decode_ms_per_ctx_token * seg.n_decode
        if seg.n_prefill:
            q = seg.tokens[seg.is_prefill].astype(np.float64)
            c0 = seg.ctx0[seg.is_prefill].astype(np.float64)
            inv_eff = (q + tb.prefill_half_eff_tokens) / q
            const += tb.prefill_ms_per_attn_unit * float((q * (q / 2.0 + c0) * inv_eff).sum())
            per_j += tb.prefill_ms_per_attn_unit * float((q * q * inv_eff).sum())
        t = const + per_j * j
        return np.asarray(t * _noise(rng, self.noise_sigma, steps), dtype=np.float64)
