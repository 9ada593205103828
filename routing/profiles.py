"""Step-time profiles: Eq. 9 coefficients per ``<model>@<gpu>`` and the measured tables behind them.

A profile (``data/profiles/profiles.json``) holds, per model and GPU:

* ``coefficients``: the Eq. 9 model SFS uses (``c0..c3`` in ms), fitted by NNLS
  (:func:`routing.steptime.fit_nnls`) on step timings priced by the profile's table;
* ``table``: the measured-table step time the simulated engine uses (``sim.timing``)::

      t = cpu_ms + cpu_ms_per_seq*n_seqs + dense_ms(N)            (Vidur per-operator tables)
          + decode_ms_per_seq*n_decode + decode_ms_per_ctx_token*sum ctx   (KV reads)
          + prefill_ms_per_attn_unit * sum q*(q/2+ctx) * (q + q_half)/q     (prefill attention)

  where ``dense_ms`` is interpolated in Vidur's H100 operator timings and the scalars are
  calibrated by NNLS against real end-to-end timings (inference-sim vLLM 0.11 runs,
  Splitwise DGX-H100 measurements) starting from roofline priors;
* ``fit``: the Eq. 9 fit error against the table and against the real timings.

Nothing here reads a file: :class:`Profiles` is built from the parsed document, which
``loaders.profiles`` reads (once, cached; ``load_profile(name)`` there). The tables and fits
are rebuilt (``offline.profiles``) by ``switchyard profiles build`` / ``refit`` (source and
license of every number: ``data/profiles/README.md``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.steptime import StepTimeModel, attn_units

FloatArray = npt.NDArray[np.float64]

TABLE_SCALARS = (
    "cpu_ms",
    "cpu_ms_per_seq",
    "decode_ms_per_seq",
    "decode_ms_per_ctx_token",
    "prefill_ms_per_attn_unit",
)


@dataclass(frozen=True)
class Profiles:
    """Every profile record of one ``profiles.json`` document, by lowercase name (pure: the
    document is read by ``loaders.profiles``). ``source`` names where it came from."""

    records: Mapping[str, Mapping[str, Any]]
    source: str = ""

    @classmethod
    def from_document(cls, doc: Mapping[str, Any], source: str = "") -> Profiles:
        """From the parsed ``profiles.json`` (``{"profiles": {name: record}}``)."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("profiles"), Mapping):
            raise ValueError(f"step-time profiles {source or 'document'} has no 'profiles' object")
        return cls({str(k).lower(): v for k, v in doc["profiles"].items()}, source)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "") -> Profiles:
        """From the text of a ``profiles.json``."""
        return cls.from_document(json.loads(text), source)

    def all(self) -> dict[str, Any]:
        """Every profile record, by name."""
        return dict(self.records)

    def names(self) -> list[str]:
        """Profile names, lowercase ``<model>@<gpu>``, sorted."""
        return sorted(self.records)

    def record(self, name: str) -> dict[str, Any]:
        """The raw record of one profile (coefficients, table, fit errors, provenance)."""
        key = name.strip().lower()
        if key not in self.records:
            raise KeyError(f"unknown step-time profile {name!r}; known: {sorted(self.records)}")
        rec: dict[str, Any] = dict(self.records[key])
        return rec

    def model(self, name: str) -> StepTimeModel:
        """The fitted Eq. 9 model of profile ``name`` (e.g. ``codellama-34b-instruct-hf@h100``)."""
        c = self.record(name)["coefficients"]
        return StepTimeModel(
            c0_ms=float(c["c0_ms"]),
            c1_ms_per_token=float(c["c1_ms_per_token"]),
            c2_ms_per_ctx_token=float(c["c2_ms_per_ctx_token"]),
            c3_ms_per_attn_unit=float(c["c3_ms_per_attn_unit"]),
        )

    def table(self, name: str) -> Table:
        """The measured-table step time of profile ``name``."""
        return Table.from_record(self.record(name))


# ---- the measured-table step time (pure; sim.timing.TableTiming evaluates the same) ----------


@dataclass(frozen=True)
class Table:
    """Parameters of the measured-table step time (see module docstring). Times in ms."""

    dense_tokens: FloatArray
    dense_ms: FloatArray
    cpu_ms: float
    cpu_ms_per_seq: float
    decode_ms_per_seq: float
    decode_ms_per_ctx_token: float
    prefill_ms_per_attn_unit: float
    prefill_half_eff_tokens: float

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Table:
        t = rec["table"]
        return cls(
            dense_tokens=np.asarray(t["dense_tokens"], dtype=np.float64),
            dense_ms=np.asarray(t["dense_ms"], dtype=np.float64),
            cpu_ms=float(t["cpu_ms"]),
            cpu_ms_per_seq=float(t["cpu_ms_per_seq"]),
            decode_ms_per_seq=float(t["decode_ms_per_seq"]),
            decode_ms_per_ctx_token=float(t["decode_ms_per_ctx_token"]),
            prefill_ms_per_attn_unit=float(t["prefill_ms_per_attn_unit"]),
            prefill_half_eff_tokens=float(t["prefill_half_eff_tokens"]),
        )

    def dense(self, n_tokens: npt.ArrayLike) -> FloatArray:
        return dense_interp(self.dense_tokens, self.dense_ms, n_tokens)

    def step_ms(
        self,
        n_tokens: npt.ArrayLike,
        n_seqs: npt.ArrayLike,
        n_decode: npt.ArrayLike,
        decode_ctx: npt.ArrayLike,
        attn_eff_units: npt.ArrayLike,
    ) -> FloatArray:
        """Vectorised over steps; ``attn_eff_units`` from :func:`attn_eff_units`."""
        t = (
            self.cpu_ms
            + self.cpu_ms_per_seq * np.asarray(n_seqs, dtype=np.float64)
            + self.dense(n_tokens)
            + self.decode_ms_per_seq * np.asarray(n_decode, dtype=np.float64)
            + self.decode_ms_per_ctx_token * np.asarray(decode_ctx, dtype=np.float64)
            + self.prefill_ms_per_attn_unit * np.asarray(attn_eff_units, dtype=np.float64)
        )
        return np.asarray(t, dtype=np.float64)


def dense_interp(x: FloatArray, y: FloatArray, n_tokens: npt.ArrayLike) -> FloatArray:
    """Piecewise-linear in the table; beyond its last point, linear with the slope of its
    upper half (adjacent points are too noisy to extrapolate from)."""
    n = np.asarray(n_tokens, dtype=np.float64)
    out = np.interp(n, x, y)
    h = int(np.searchsorted(x, x[-1] / 2.0))
    h = min(h, x.size - 2)
    slope = max((y[-1] - y[h]) / (x[-1] - x[h]), 0.0)
    return np.asarray(np.where(n > x[-1], y[-1] + slope * (n - x[-1]), out), dtype=np.float64)


def attn_eff_units(chunk: npt.ArrayLike, ctx: npt.ArrayLike, half_eff_tokens: float) -> FloatArray:
    """Prefill attention work divided by kernel efficiency ``q / (q + q_half)``."""
    q = np.asarray(chunk, dtype=np.float64)
    return np.asarray(
        attn_units(q, ctx) * (q + half_eff_tokens) / np.maximum(q, 1e-9), dtype=np.float64
    )
