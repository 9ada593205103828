"""Real routing data in memory: the long table, the wide view and splits by query (pure).

The readers of the three source formats (``irt-wide``, ``long``, ``nq-records``) live in
``offline.datasets`` (``load_routing_data``).
Every reader returns a ``LongTable``; ``to_wide`` pivots it into ``RoutingData``
(``scores[n, m]`` and friends). Splits are by query, never by row. Nothing here reads a
file: ``routing/`` takes the arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from routing.cost import cost_usd as _cost_usd
from routing.cost import estimate_prompt_tokens
from routing.types import FloatArray, IntArray

DataFormat = Literal["irt-wide", "long", "nq-records"]
FORMATS: tuple[str, ...] = ("irt-wide", "long", "nq-records")

DEFAULT_OUTPUT_TOKENS = 256.0
"""Output-length prior (tokens) where a source records none (dc9, ccf20): half of dc9's
``max_tokens=512``. Costs built on it are estimates and ``RoutingData.cost_is_estimated``
says so."""


class DataError(ValueError):
    """A data file that cannot be read; the message names the file, row and field."""


@dataclass(frozen=True)
class LongTable:
    """One row per (query, model). ``nan`` marks a field the source does not record."""

    query_id: list[str]
    task: list[str]
    text: list[str]
    model: list[str]
    score: FloatArray
    prompt_tokens: FloatArray
    output_tokens: FloatArray
    cost_usd: FloatArray
    extra_prompt_chars: IntArray  # prompt characters outside ``text`` (answer options)
    source_row: IntArray  # 1-based data row of the file each row came from (for errors)

    def __len__(self) -> int:
        return len(self.query_id)


@dataclass(frozen=True)
class ModelPrices:
    models: list[str]
    input_usd_per_token: FloatArray
    output_usd_per_token: FloatArray

    def index(self) -> dict[str, int]:
        return {m: j for j, m in enumerate(self.models)}


@dataclass(frozen=True)
class RoutingData:
    """Wide view: ``n`` queries x ``m`` models. ``nan`` in ``scores`` = not evaluated."""

    query_ids: list[str]
    tasks: list[str]
    texts: list[str]
    models: list[str]
    scores: FloatArray  # [n, m] in [0, 1]
    input_usd_per_token: FloatArray  # [m]
    output_usd_per_token: FloatArray  # [m]
    prompt_tokens: IntArray  # [n] (estimated from text unless the source counts them)
    output_tokens: FloatArray  # [n, m], nan where unknown
    cost_usd: FloatArray  # [n, m] realised cost where the source has it, else nan
    source: str = ""
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n, m = len(self.query_ids), len(self.models)
        for name, arr, shape in (
            ("scores", self.scores, (n, m)),
            ("output_tokens", self.output_tokens, (n, m)),
            ("cost_usd", self.cost_usd, (n, m)),
            ("input_usd_per_token", self.input_usd_per_token, (m,)),
            ("output_usd_per_token", self.output_usd_per_token, (m,)),
            ("prompt_tokens", self.prompt_tokens, (n,)),
        ):
            if arr.shape != shape:
                raise ValueError(f"RoutingData.{name} has shape {arr.shape}, expected {shape}")
        for name, seq in (("tasks", self.tasks), ("texts", self.texts)):
            if len(seq) != n:
                raise ValueError(f"RoutingData.{name} has {len(seq)} entries, expected {n}")

    @property
    def n(self) -> int:
        return len(self.query_ids)

    @property
    def m(self) -> int:
        return len(self.models)

    @property
    def cost_is_estimated(self) -> bool:
        """True when some realised cost comes from the length prior, not the data."""
        return bool(np.isnan(self.cost_usd).any())

    def realised_cost_usd(
        self, default_output_tokens: float | FloatArray = DEFAULT_OUTPUT_TOKENS
    ) -> FloatArray:
        """Cost of each (query, model) as realised: recorded cost, else the price formula
        with recorded output tokens, else with ``default_output_tokens`` (scalar or [m])."""
        prior = np.broadcast_to(np.asarray(default_output_tokens, dtype=np.float64), (self.m,))
        out_tok = np.where(np.isnan(self.output_tokens), prior[None, :], self.output_tokens)
        formula = _cost_usd(
            self.prompt_tokens, out_tok, self.input_usd_per_token, self.output_usd_per_token
        )
        out: FloatArray = np.where(np.isnan(self.cost_usd), formula, self.cost_usd)
        return out

    def subset(self, rows: IntArray | Sequence[int]) -> RoutingData:
        idx = np.asarray(rows, dtype=np.int64)
        return RoutingData(
            query_ids=[self.query_ids[i] for i in idx],
            tasks=[self.tasks[i] for i in idx],
            texts=[self.texts[i] for i in idx],
            models=list(self.models),
            scores=self.scores[idx],
            input_usd_per_token=self.input_usd_per_token.copy(),
            output_usd_per_token=self.output_usd_per_token.copy(),
            prompt_tokens=self.prompt_tokens[idx],
            output_tokens=self.output_tokens[idx],
            cost_usd=self.cost_usd[idx],
            source=self.source,
            meta=dict(self.meta),
        )

    def select_models(self, models: Sequence[str]) -> RoutingData:
        """The same queries restricted to (and reordered as) ``models``."""
        pos = {m: j for j, m in enumerate(self.models)}
        missing = [m for m in models if m not in pos]
        if missing:
            raise KeyError(f"unknown model(s) {missing}; the data has {self.models}")
        cols = np.array([pos[m] for m in models], dtype=np.int64)
        return RoutingData(
            query_ids=list(self.query_ids),
            tasks=list(self.tasks),
            texts=list(self.texts),
            models=list(models),
            scores=self.scores[:, cols],
            input_usd_per_token=self.input_usd_per_token[cols],
            output_usd_per_token=self.output_usd_per_token[cols],
            prompt_tokens=self.prompt_tokens.copy(),
            output_tokens=self.output_tokens[:, cols],
            cost_usd=self.cost_usd[:, cols],
            source=self.source,
            meta=dict(self.meta),
        )


# ---------------------------------------------------------------------------- wide view


def to_wide(long: LongTable, prices: ModelPrices | None, source: str = "") -> RoutingData:
    """Pivot to ``[n, m]``. Repeated (query, model) rows are averaged (dc9 repeats some
    texts across its splits); queries keep first-seen order, models the price-table order."""
    if len(long) == 0:
        raise DataError(f"{source or 'data'}: no rows")
    seen_models: dict[str, int] = {}
    for k, name in enumerate(long.model):
        seen_models.setdefault(name, k)
    if prices is not None:
        pidx = prices.index()
        unknown = [name for name in seen_models if name not in pidx]
        if unknown:
            row = int(long.source_row[seen_models[unknown[0]]])
            raise DataError(
                f"row {row}: model {unknown[0]!r} is not in the models table "
                f"(known: {', '.join(prices.models)})"
            )
        models = [name for name in prices.models if name in seen_models]
        pin = np.array([prices.input_usd_per_token[pidx[name]] for name in models])
        pout = np.array([prices.output_usd_per_token[pidx[name]] for name in models])
    else:
        models = list(seen_models)
        pin = np.full(len(models), np.nan)
        pout = np.full(len(models), np.nan)
    midx = {name: j for j, name in enumerate(models)}
    qpos: dict[str, int] = {}
    first_row: list[int] = []
    for k, q in enumerate(long.query_id):
        if q not in qpos:
            qpos[q] = len(first_row)
            first_row.append(k)
    n, m = len(first_row), len(models)
    rows_q = np.fromiter((qpos[q] for q in long.query_id), np.int64, len(long))
    rows_m = np.fromiter((midx[name] for name in long.model), np.int64, len(long))
    flat = rows_q * m + rows_m

    def _mean(values: FloatArray) -> FloatArray:
        ok = ~np.isnan(values)
        s = np.bincount(flat[ok], weights=values[ok], minlength=n * m)
        c = np.bincount(flat[ok], minlength=n * m)
        with np.errstate(invalid="ignore", divide="ignore"):
            out: FloatArray = np.where(c > 0, s / np.maximum(c, 1), np.nan).reshape(n, m)
        return out

    first = np.asarray(first_row, dtype=np.int64)
    texts = [long.text[k] for k in first]
    prompt = long.prompt_tokens[first]
    estimated = estimate_prompt_tokens(texts, long.extra_prompt_chars[first])
    prompt_tokens = np.where(np.isnan(prompt), estimated, prompt).astype(np.int64)
    return RoutingData(
        query_ids=[long.query_id[k] for k in first],
        tasks=[long.task[k] for k in first],
        texts=texts,
        models=models,
        scores=_mean(long.score),
        input_usd_per_token=pin.astype(np.float64),
        output_usd_per_token=pout.astype(np.float64),
        prompt_tokens=prompt_tokens,
        output_tokens=_mean(long.output_tokens),
        cost_usd=_mean(long.cost_usd),
        source=source,
    )


def split_by_query(
    data: RoutingData, test_fraction: float, seed: int = 0
) -> tuple[RoutingData, RoutingData]:
    """Train/test split of whole queries (rows of the wide view), stratified by task so
    every task keeps its share; the same seed gives the same split."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    tasks = np.asarray(data.tasks, dtype=object)
    test_rows: list[IntArray] = []
    for t in sorted(set(data.tasks)):
        rows = np.flatnonzero(tasks == t)
        rows = rows[rng.permutation(len(rows))]
        k = int(round(test_fraction * len(rows)))
        test_rows.append(rows[:k])
    test = np.sort(np.concatenate(test_rows)) if test_rows else np.zeros(0, np.int64)
    mask = np.zeros(data.n, dtype=bool)
    mask[test] = True
    if mask.all() or not mask.any():
        raise ValueError(
            f"split of {data.n} queries with test_fraction={test_fraction} leaves one side empty"
        )
    return data.subset(np.flatnonzero(~mask)), data.subset(np.flatnonzero(mask))
