"""Traffic for the simulator: when queries arrive and what each one carries.

Arrival processes (all in virtual seconds, deterministic given a ``numpy`` Generator):

- Poisson at a fixed rate (paper A, "Evaluation": Poisson arrivals);
- MMPP, a Markov-modulated Poisson process with two or more states (paper A's bursty
  arrivals): the modulating chain stays in state k for an Exp(mean_dwell_s[k]) time and
  then jumps by ``transition[k]``; while in k arrivals are Poisson(rates[k]). Its long-run
  rate is Σ_k π_k·rates[k] with π_k ∝ ν_k·mean_dwell_s[k] (ν: stationary law of the jump
  chain) — ``MMPPSpec.mean_rate_per_s``;
- replay of the real traces in ../shared/data/traces (Azure LLM 2023 code and conv,
  Mooncake FAST'25 synthetic): arrival times and token counts as recorded;
- ServeGen per-client window statistics (rate, fitted Gamma/Weibull inter-arrival law)
  turned into arrivals by sampling each client's IATs and rescaling them to its rate, as
  ServeGen's own generator does;
- rate scaling (time compression: x2 = the same trace twice as fast);
- adversarial batch ordering (paper B, "adversarial batching"): hard, expensive queries
  bunched into the same batches.

Each arrival is joined to one query of a routing dataset (``RoutingData``): its text, the
realised score of every model, token counts; and gets a TTFT SLO from ``SloSpec``.
File reading lives in the ``load_*`` functions only.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from schemas import Query

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
HashArray = npt.NDArray[np.uint64]


class TrafficError(ValueError):
    """Bad traffic parameters or an unreadable trace; the message names what was wrong."""


# ------------------------------------------------------------------ arrival processes


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> FloatArray:
    """Arrival times of a Poisson process on [0, duration_s)."""
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise TrafficError(f"poisson rate_per_s must be a finite number > 0, got {rate_per_s}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise TrafficError(f"duration_s must be a finite number > 0, got {duration_s}")
    n = int(rng.poisson(rate_per_s * duration_s))
    return np.sort(rng.uniform(0.0, duration_s, size=n))


@dataclass(frozen=True)
class MMPPSpec:
    """A Markov-modulated Poisson process with K ≥ 2 states.

    ``transition[k]`` is the jump law out of state k (zero diagonal); when omitted the
    chain jumps uniformly to another state (for K = 2: it alternates).
    """

    rates_per_s: tuple[float, ...]
    mean_dwell_s: tuple[float, ...]
    transition: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        k = len(self.rates_per_s)
        if k < 2:
            raise TrafficError(f"MMPP needs at least 2 states, got {k}")
        if len(self.mean_dwell_s) != k:
            raise TrafficError(
                f"MMPP mean_dwell_s has {len(self.mean_dwell_s)} entries, rates_per_s has {k}"
            )
        for i, r in enumerate(self.rates_per_s):
            if not (math.isfinite(r) and r >= 0):
                raise TrafficError(f"MMPP rates_per_s[{i}] must be finite and >= 0, got {r}")
        for i, d in enumerate(self.mean_dwell_s):
            if not (math.isfinite(d) and d > 0):
                raise TrafficError(f"MMPP mean_dwell_s[{i}] must be finite and > 0, got {d}")
        p = self.jump_matrix()
        if (p < 0).any() or not np.allclose(p.sum(axis=1), 1.0) or np.any(np.diag(p) != 0):
            raise TrafficError("MMPP transition rows must be >= 0, sum to 1, with a zero diagonal")

    @property
    def k(self) -> int:
        return len(self.rates_per_s)

    def jump_matrix(self) -> FloatArray:
        k = len(self.rates_per_s)
        if self.transition is None:
            p = np.full((k, k), 1.0 / (k - 1))
            np.fill_diagonal(p, 0.0)
            return p
        p = np.asarray(self.transition, dtype=np.float64)
        if p.shape != (k, k):
            raise TrafficError(f"MMPP transition must be {k}x{k}, got shape {p.shape}")
        return p

    def stationary(self) -> FloatArray:
        """Long-run share of time in each state."""
        p = self.jump_matrix()
        w, v = np.linalg.eig(p.T)
        nu = np.real(v[:, int(np.argmin(np.abs(w - 1.0)))])
        nu = nu / nu.sum()
        pi = nu * np.asarray(self.mean_dwell_s)
        out: FloatArray = pi / pi.sum()
        return out

    @property
    def mean_rate_per_s(self) -> float:
        return float(self.stationary() @ np.asarray(self.rates_per_s))

    def scaled(self, factor: float) -> MMPPSpec:
        """The same burst pattern with every rate multiplied by ``factor``."""
        return MMPPSpec(
            tuple(r * factor for r in self.rates_per_s), self.mean_dwell_s, self.transition
        )

    @classmethod
    def bursty(
        cls,
        mean_rate_per_s: float,
        burst_ratio: float = 4.0,
        burst_share: float = 0.2,
        mean_burst_s: float = 20.0,
    ) -> MMPPSpec:
        """Two states, a burst at ``burst_ratio`` × the calm rate for ``burst_share`` of
        the time, with long-run rate ``mean_rate_per_s``."""
        if not 0 < burst_share < 1:
            raise TrafficError(f"burst_share must be in (0, 1), got {burst_share}")
        if burst_ratio < 1:
            raise TrafficError(f"burst_ratio must be >= 1, got {burst_ratio}")
        calm = mean_rate_per_s / (1 - burst_share + burst_share * burst_ratio)
        calm_dwell = mean_burst_s * (1 - burst_share) / burst_share
        return cls((calm, calm * burst_ratio), (calm_dwell, mean_burst_s))


def mmpp_arrivals(
    spec: MMPPSpec, duration_s: float, rng: np.random.Generator, initial_state: int | None = None
) -> tuple[FloatArray, IntArray]:
    """Arrival times on [0, duration_s) and the modulating state of each arrival.

    The chain starts in its stationary law unless ``initial_state`` is given.
    """
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise TrafficError(f"duration_s must be a finite number > 0, got {duration_s}")
    p = spec.jump_matrix()
    pi = spec.stationary()
    state = int(rng.choice(spec.k, p=pi)) if initial_state is None else int(initial_state)
    if not 0 <= state < spec.k:
        raise TrafficError(f"initial_state must be in [0, {spec.k}), got {initial_state}")
    times: list[FloatArray] = []
    states: list[IntArray] = []
    t = 0.0
    while t < duration_s:
        dwell = float(rng.exponential(spec.mean_dwell_s[state]))
        end = min(t + dwell, duration_s)
        rate = spec.rates_per_s[state]
        if rate > 0:
            n = int(rng.poisson(rate * (end - t)))
            times.append(np.sort(rng.uniform(t, end, size=n)))
            states.append(np.full(n, state, dtype=np.int64))
        t = end
        state = int(rng.choice(spec.k, p=p[state]))
    if not times:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    return np.concatenate(times), np.concatenate(states)


# ------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class Trace:
    """Arrivals with their recorded token counts (one row per request, time-ordered)."""

    arrival_s: FloatArray
    input_tokens: IntArray
    output_tokens: IntArray
    name: str = ""
    # per row, the prompt's chained prefix block hashes (Mooncake's hash_ids), if recorded
    hash_ids: list[HashArray] | None = None
    hash_block_tokens: int = 512

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_tokens) != n or len(self.output_tokens) != n:
            raise TrafficError(
                f"trace {self.name!r}: arrival_s has {n} rows, input_tokens {len(self.input_tokens)}, "
                f"output_tokens {len(self.output_tokens)}"
            )
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise TrafficError(f"trace {self.name!r}: hash_ids has {len(self.hash_ids)} rows, not {n}")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise TrafficError(f"trace {self.name!r}: arrival_s must be non-decreasing")

    @property
    def n(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if self.n else 0.0

    @property
    def mean_rate_per_s(self) -> float:
        return self.n / self.duration_s if self.duration_s > 0 else 0.0

    def window(self, start_s: float, duration_s: float) -> Trace:
        """Rows with ``start_s <= arrival_s < start_s + duration_s``, re-based to start at 0."""
        keep = (self.arrival_s >= start_s) & (self.arrival_s < start_s + duration_s)
        hashes = None
        if self.hash_ids is not None:
            hashes = [h for h, k in zip(self.hash_ids, keep.tolist(), strict=True) if k]
        return Trace(
            self.arrival_s[keep] - start_s,
            self.input_tokens[keep],
            self.output_tokens[keep],
            self.name,
            hashes,
            self.hash_block_tokens,
        )

    def scaled(self, rate_scale: float) -> Trace:
        """Rate scaling by time compression: ``rate_scale`` = 2 replays twice as fast."""
        return Trace(
            scale_rate(self.arrival_s, rate_scale),
            self.input_tokens,
            self.output_tokens,
            self.name,
            self.hash_ids,
            self.hash_block_tokens,
        )


TRACE_FILES = {
    "azure-conv": "azure_llm_2023_conv.csv.gz",
    "azure-code": "azure_llm_2023_code.csv.gz",
    "mooncake": "mooncake_fast25_synthetic.csv.gz",
}


def _open_text(path: Path) -> io.TextIOBase:
    if not path.exists():
        raise TrafficError(f"{path}: no such file")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115


def load_trace(path: str | Path) -> Trace:
    """Read a trace CSV (``arrival_s, input_tokens, output_tokens``, optionally gzip; a
    ``hash_ids`` column, as in the Mooncake trace, gives each prompt's prefix block hashes,
    512 tokens per block)."""
    p = Path(path)
    cols: dict[str, list[float]] = {"arrival_s": [], "input_tokens": [], "output_tokens": []}
    with _open_text(p) as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in cols if c not in (reader.fieldnames or [])]
        if missing:
            raise TrafficError(f"{p}: missing column(s) {missing}; header is {reader.fieldnames}")
        has_hashes = "hash_ids" in (reader.fieldnames or [])
        hashes: list[HashArray] = []
        for row_no, row in enumerate(reader, start=2):
            for c, acc in cols.items():
                try:
                    acc.append(float(row[c]))
                except (TypeError, ValueError):
                    raise TrafficError(
                        f"{p} line {row_no}: {c} must be a number, got {row[c]!r}"
                    ) from None
            if has_hashes:
                try:
                    hashes.append(np.array(row["hash_ids"].split(), dtype=np.uint64))
                except (AttributeError, ValueError, OverflowError):
                    raise TrafficError(
                        f"{p} line {row_no}: hash_ids must be space-separated integers "
                        f"in [0, 2^64), got {str(row['hash_ids'])[:60]!r}"
                    ) from None
    arr = np.asarray(cols["arrival_s"])
    order = np.argsort(arr, kind="stable")
    return Trace(
        arr[order] - (arr.min() if arr.size else 0.0),
        np.asarray(cols["input_tokens"], dtype=np.int64)[order],
        np.asarray(cols["output_tokens"], dtype=np.int64)[order],
        p.name,
        [hashes[i] for i in order.tolist()] if has_hashes else None,
    )


def resolve_trace(name_or_path: str, traces_dir: Path) -> Path:
    """A trace path from a short name (``azure-conv``, ``azure-code``, ``mooncake``) or a path."""
    if name_or_path in TRACE_FILES:
        return traces_dir / TRACE_FILES[name_or_path]
    return Path(name_or_path)


def scale_rate(arrival_s: FloatArray, rate_scale: float) -> FloatArray:
    """Time compression: the same arrival pattern ``rate_scale`` times as dense."""
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise TrafficError(f"rate_scale must be a finite number > 0, got {rate_scale}")
    out: FloatArray = np.asarray(arrival_s, dtype=np.float64) / rate_scale
    return out


# ---------------------------------------------------------------------- ServeGen


@dataclass(frozen=True)
class ServeGenWindows:
    """Per-(client, window) rate and inter-arrival law of one ServeGen model group."""

    client_id: IntArray
    window_start_s: FloatArray
    rate_per_s: FloatArray
    dist: npt.NDArray[np.bool_]  # True = Weibull, False = Gamma
    shape: FloatArray
    scale: FloatArray
    window_s: float = 600.0


def load_servegen(
    path: str | Path, category: str = "language", model_group: str = "m-large"
) -> ServeGenWindows:
    """Read ``servegen_client_windows.csv.gz`` rows of one (category, model_group)."""
    p = Path(path)
    rows: list[tuple[int, float, float, bool, float, float]] = []
    with _open_text(p) as fh:
        for line_no, row in enumerate(csv.DictReader(fh), start=2):
            if row["category"] != category or row["model_group"] != model_group:
                continue
            dist = row["iat_dist"]
            if dist not in ("Gamma", "Weibull"):
                raise TrafficError(
                    f"{p} line {line_no}: iat_dist must be Gamma or Weibull, got {dist!r}"
                )
            rows.append(
                (
                    int(row["client_id"]),
                    float(row["window_start_s"]),
                    float(row["rate_rps"]),
                    dist == "Weibull",
                    float(row["shape"]),
                    float(row["scale"]),
                )
            )
    if not rows:
        raise TrafficError(f"{p}: no rows for category={category!r} model_group={model_group!r}")
    a = list(zip(*rows, strict=True))
    return ServeGenWindows(
        np.asarray(a[0], np.int64),
        np.asarray(a[1]),
        np.asarray(a[2]),
        np.asarray(a[3], bool),
        np.asarray(a[4]),
        np.asarray(a[5]),
    )


def servegen_arrivals(
    win: ServeGenWindows,
    start_s: float,
    duration_s: float,
    rng: np.random.Generator,
    clients: Sequence[int] | None = None,
) -> FloatArray:
    """Arrivals on [0, duration_s) from every active client window overlapping
    [start_s, start_s + duration_s): IATs drawn from the client's fitted law, rescaled
    so their mean is 1/rate (ServeGen's generator does the same)."""
    if duration_s <= 0:
        raise TrafficError(f"duration_s must be > 0, got {duration_s}")
    end_s = start_s + duration_s
    sel = (
        (win.window_start_s < end_s)
        & (win.window_start_s + win.window_s > start_s)
        & (win.rate_per_s > 0)
    )
    if clients is not None:
        sel &= np.isin(win.client_id, np.asarray(clients, dtype=np.int64))
    out: list[FloatArray] = []
    for i in np.flatnonzero(sel):
        rate, shape, scale = float(win.rate_per_s[i]), float(win.shape[i]), float(win.scale[i])
        lo = max(float(win.window_start_s[i]), start_s)
        hi = min(float(win.window_start_s[i]) + win.window_s, end_s)
        need = int(rate * (hi - lo) * 1.5) + 16
        if win.dist[i]:
            iat = scale * rng.weibull(shape, size=need)
            mean = scale * math.gamma(1.0 + 1.0 / shape)
        else:
            iat = rng.gamma(shape, scale, size=need)
            mean = shape * scale
        iat *= (1.0 / rate) / mean
        # Random phase so windows do not all start with an arrival at their edge.
        t = lo + float(rng.uniform(0, 1.0 / rate)) + np.cumsum(iat) - iat[0]
        while t[-1] < hi:  # rare: heavy-tailed draws came up short
            more = (
                rng.gamma(shape, scale, size=need)
                if not win.dist[i]
                else scale * rng.weibull(shape, size=need)
            )
            more *= (1.0 / rate) / mean
            t = np.concatenate([t, t[-1] + np.cumsum(more)])
        out.append(t[t < hi] - start_s)
    if not out:
        return np.zeros(0)
    return np.sort(np.concatenate(out))


# ------------------------------------------------------------------------- SLOs


@dataclass(frozen=True)
class SloSpec:
    """Distribution of per-query TTFT SLOs in ms.

    ``fixed:2000`` | ``uniform:500,5000`` | ``lognormal:2000,0.5`` (median, sigma) |
    ``choice:500,2000,8000`` (equally likely).
    """

    kind: Literal["fixed", "uniform", "lognormal", "choice"]
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        need = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if self.kind in need and len(self.params) != need[self.kind]:
            raise TrafficError(
                f"SLO {self.kind} takes {need[self.kind]} number(s), got {list(self.params)}"
            )
        if self.kind == "choice" and not self.params:
            raise TrafficError("SLO choice needs at least one value")
        if self.kind not in ("fixed", "uniform", "lognormal", "choice"):
            raise TrafficError(
                f"unknown SLO kind {self.kind!r}; use fixed, uniform, lognormal or choice"
            )
        values = self.params if self.kind != "lognormal" else self.params[:1]
        if any(not (math.isfinite(v) and v > 0) for v in values):
            raise TrafficError(
                f"SLO {self.kind} values must be finite and > 0 ms, got {list(self.params)}"
            )
        if self.kind == "uniform" and self.params[0] > self.params[1]:
            raise TrafficError(f"SLO uniform needs low <= high, got {list(self.params)}")

    @classmethod
    def parse(cls, text: str) -> SloSpec:
        kind, _, rest = text.partition(":")
        try:
            params = tuple(float(x) for x in rest.split(",") if x.strip())
        except ValueError:
            raise TrafficError(
                f"SLO spec {text!r}: parameters must be numbers, e.g. uniform:500,5000"
            ) from None
        return cls(kind.strip(), params)  # type: ignore[arg-type]

    def sample(self, n: int, rng: np.random.Generator) -> FloatArray:
        if self.kind == "fixed":
            return np.full(n, self.params[0])
        if self.kind == "uniform":
            return rng.uniform(self.params[0], self.params[1], size=n)
        if self.kind == "lognormal":
            return self.params[0] * np.exp(self.params[1] * rng.standard_normal(n))
        out: FloatArray = np.asarray(self.params)[rng.integers(0, len(self.params), size=n)]
        return out

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(f'{p:g}' for p in self.params)}"


# ------------------------------------------------------------------ adversarial


def adversarial_order(hardness: FloatArray, batch_size: int, rng: np.random.Generator) -> IntArray:
    """Paper B's adversarial batching: a permutation of the rows in which each run of
    ``batch_size`` consecutive rows holds queries of similar hardness (hardest together),
    with the order of those runs shuffled so hard bursts hit at random times."""
    h = np.asarray(hardness, dtype=np.float64)
    if batch_size < 1:
        raise TrafficError(f"batch_size must be >= 1, got {batch_size}")
    if not np.isfinite(h).all():
        raise TrafficError("hardness must be finite for every row")
    # Random tie-break, then hardest first.
    order = np.lexsort((rng.random(h.size), -h))
    chunks = [order[i : i + batch_size] for i in range(0, h.size, batch_size)]
    perm = rng.permutation(len(chunks))
    return np.concatenate([chunks[i] for i in perm]) if chunks else np.zeros(0, dtype=np.int64)


def default_hardness(scores: FloatArray, cost_usd: FloatArray) -> FloatArray:
    """Expected spend of a quality-seeking router on each query: queries that only the
    expensive models solve, and long ones, score highest."""
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0)
    c = np.asarray(cost_usd, dtype=np.float64)
    weight = s + 1e-3
    out: FloatArray = (1.0 - s.mean(axis=1)) * (weight * c).sum(axis=1) / weight.sum(axis=1)
    return out


# --------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """Arrivals joined to dataset queries: everything the evaluator needs, as arrays.

    ``row[i]`` is the query's row in the routing data; ``output_tokens[i, j]`` is what
    model j would generate for it (realised, used by the engine and for realised cost);
    ``scores[i, j]`` the realised score of model j.
    """

    arrival_s: FloatArray  # [n], non-decreasing
    row: IntArray  # [n]
    prompt_tokens: IntArray  # [n]
    output_tokens: IntArray  # [n, m]
    scores: FloatArray  # [n, m]
    slo_ms: FloatArray  # [n]
    texts: list[str]  # [n]
    tasks: list[str]  # [n]
    models: list[str]  # [m]
    tenant: str = "default"
    name: str = ""
    # per arrival, its prompt's prefix block hashes (None: derived from the text)
    prefix_hashes: list[HashArray] | None = None
    prefix_block_tokens: int = 512

    def __post_init__(self) -> None:
        n, m = len(self.arrival_s), len(self.models)
        if self.prefix_hashes is not None and len(self.prefix_hashes) != n:
            raise TrafficError(f"Workload.prefix_hashes must have {n} entries")
        for what, arr, shape in (
            ("row", self.row, (n,)),
            ("prompt_tokens", self.prompt_tokens, (n,)),
            ("output_tokens", self.output_tokens, (n, m)),
            ("scores", self.scores, (n, m)),
            ("slo_ms", self.slo_ms, (n,)),
        ):
            if np.shape(arr) != shape:
                raise TrafficError(f"Workload.{what} has shape {np.shape(arr)}, expected {shape}")
        if len(self.texts) != n or len(self.tasks) != n:
            raise TrafficError(f"Workload texts/tasks must have {n} entries")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise TrafficError("Workload.arrival_s must be non-decreasing")
        if n and (self.prompt_tokens < 1).any():
            raise TrafficError("Workload.prompt_tokens must be >= 1")

    @property
    def n(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if self.n else 0.0

    def query_id(self, i: int) -> str:
        return f"{self.name or 'q'}-{i}"

    def query(self, i: int, max_tokens: int | None = None) -> Query:
        """The wire ``Query`` of arrival i (what a producer would put on Kafka)."""
        return Query.model_construct(
            id=self.query_id(i),
            tenant=self.tenant,
            ttft_slo_ms=float(self.slo_ms[i]),
            prompt_tokens=int(self.prompt_tokens[i]),
            created_at=float(self.arrival_s[i]),
            task=self.tasks[i] or None,
            prompt=self.texts[i] or " ",
            max_tokens=max_tokens,
            messages=None,
            prefix_hashes=None if self.prefix_hashes is None else self.prefix_hashes[i].tolist(),
            prefix_block_tokens=self.prefix_block_tokens,
        )

    def reordered(self, order: IntArray, name: str | None = None) -> Workload:
        """The same arrival times carrying the queries in ``order`` (adversarial batching)."""
        idx = np.asarray(order, dtype=np.int64)
        if sorted(idx.tolist()) != list(range(self.n)):
            raise TrafficError(f"order must be a permutation of the {self.n} arrivals")
        return Workload(
            self.arrival_s,
            self.row[idx],
            self.prompt_tokens[idx],
            self.output_tokens[idx],
            self.scores[idx],
            self.slo_ms[idx],
            [self.texts[i] for i in idx],
            [self.tasks[i] for i in idx],
            list(self.models),
            self.tenant,
            self.name if name is None else name,
            None if self.prefix_hashes is None else [self.prefix_hashes[i] for i in idx],
            self.prefix_block_tokens,
        )

    def take(self, idx: IntArray) -> Workload:
        """A sub-workload (rows re-ordered as ``idx``; arrival times kept)."""
        return Workload(
            self.arrival_s[idx],
            self.row[idx],
            self.prompt_tokens[idx],
            self.output_tokens[idx],
            self.scores[idx],
            self.slo_ms[idx],
            [self.texts[i] for i in idx],
            [self.tasks[i] for i in idx],
            list(self.models),
            self.tenant,
            self.name,
            None if self.prefix_hashes is None else [self.prefix_hashes[i] for i in idx],
            self.prefix_block_tokens,
        )


def rows_by_prefix_root(
    hash_ids: Sequence[HashArray], n_data: int, rng: np.random.Generator
) -> IntArray:
    """A dataset row per arrival such that arrivals whose prompts start with the same block
    (one conversation, or one shared document / system prompt) carry the same query text:
    a multi-turn conversation keeps its topic, so its turns get consistent quality and
    length predictions. Prompts without blocks get a row each."""
    if n_data < 1:
        raise TrafficError("routing data has no queries")
    roots = np.array([int(h[0]) if h.size else -1 for h in hash_ids], dtype=np.float64)
    roots[roots < 0] = -(np.arange(int((roots < 0).sum())) + 1.0)  # each its own group
    _, group = np.unique(roots, return_inverse=True)
    pick = rng.integers(0, n_data, size=int(group.max()) + 1 if group.size else 0)
    out: IntArray = pick[group].astype(np.int64)
    return out


def build_workload(
    arrival_s: FloatArray,
    scores: FloatArray,
    texts: Sequence[str],
    tasks: Sequence[str],
    models: Sequence[str],
    data_prompt_tokens: IntArray,
    data_output_tokens: FloatArray,
    slo: SloSpec,
    rng: np.random.Generator,
    *,
    rows: IntArray | None = None,
    trace_input_tokens: IntArray | None = None,
    trace_output_tokens: IntArray | None = None,
    default_output_tokens: float | FloatArray = 256.0,
    max_output_tokens: int = 4096,
    name: str = "",
    prefix_hashes: list[HashArray] | None = None,
    prefix_block_tokens: int = 512,
) -> Workload:
    """Join arrivals to dataset queries.

    ``rows`` picks the dataset row of each arrival (default: uniform with replacement).
    Token counts: the trace's when given (so load matches the trace), else the dataset's
    prompt tokens and recorded per-model output tokens, with ``default_output_tokens`` (a
    scalar or per model) where the dataset records none.
    """
    arr = np.asarray(arrival_s, dtype=np.float64)
    n = arr.size
    s = np.asarray(scores, dtype=np.float64)
    n_data, m = s.shape
    if n_data == 0:
        raise TrafficError("routing data has no queries")
    if rows is None:
        rows = rng.integers(0, n_data, size=n)
    rows = np.asarray(rows, dtype=np.int64)
    if rows.shape != (n,):
        raise TrafficError(f"rows has shape {rows.shape}, expected ({n},)")
    if n and (rows.min() < 0 or rows.max() >= n_data):
        raise TrafficError(f"rows must index the {n_data} dataset queries")
    if trace_input_tokens is not None:
        prompt = np.maximum(np.asarray(trace_input_tokens, dtype=np.int64), 1)
    else:
        prompt = np.maximum(np.asarray(data_prompt_tokens, dtype=np.int64)[rows], 1)
    prior = np.broadcast_to(np.asarray(default_output_tokens, dtype=np.float64), (m,))
    out_data = np.asarray(data_output_tokens, dtype=np.float64)[rows]
    out = np.where(np.isnan(out_data), prior[None, :], out_data)
    if trace_output_tokens is not None:
        # The trace says how long this request's answer was; models differ around it as
        # the dataset's per-model means do (ratio to the pool mean), where known.
        t_out = np.asarray(trace_output_tokens, dtype=np.float64)
        ratio = out / np.maximum(out.mean(axis=1, keepdims=True), 1e-9)
        out = t_out[:, None] * ratio
    out_tok = np.clip(np.rint(out), 1, max_output_tokens).astype(np.int64)
    return Workload(
        arrival_s=arr,
        row=rows,
        prompt_tokens=prompt,
        output_tokens=out_tok,
        scores=np.nan_to_num(s[rows], nan=0.0),
        slo_ms=slo.sample(n, rng),
        texts=[texts[i] for i in rows],
        tasks=[tasks[i] for i in rows],
        models=list(models),
        name=name,
        prefix_hashes=prefix_hashes,
        prefix_block_tokens=prefix_block_tokens,
    )
