"""Real routing data: one loader per source into one long table, plus a wide view.

Sources (see ``../shared/data/routing/*/README.md`` and ``data/routing/README.md``):

- ``irt-wide``: one row per query, one score column per model (``irt_router_ccf20``);
- ``long``: one row per (query, model) (``llmrouter_dc9`` ``scores_long.csv.gz``, or any
  CSV with ``query_id|query_hash|q_id``, ``text|query|question``, ``model|llm_name``,
  ``score|perf`` and optional ``task``, ``prompt_tokens``, ``output_tokens``,
  ``cost_usd``, ``choices_chars``);
- ``nq-records``: ``llmrouter_nq6`` JSON Lines with per-model responses and a real cost
  in micro-USD (output tokens = cost / price per 1M tokens).

Every loader returns a ``LongTable``; ``to_wide`` pivots it into ``RoutingData``
(``scores[n, m]`` and friends). Splits are by query, never by row. File reading lives
here and nowhere else in ``routing/``.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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

_ID_COLS = ("query_id", "query_hash", "q_id", "id")
_TEXT_COLS = ("text", "query", "question", "prompt")
_MODEL_COLS = ("model", "llm_name")
_SCORE_COLS = ("score", "perf")
_IRT_META = {"task", "id", "query_id", "question", "query", "text", "prompt", "split"}


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


# ---------------------------------------------------------------------------- reading


def _open_text(path: Path) -> io.TextIOBase:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115


def _csv_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    csv.field_size_limit(1 << 30)
    fh = _open_text(path)
    reader = csv.DictReader(fh)
    header = list(reader.fieldnames or [])
    if not header:
        fh.close()
        raise DataError(f"{path}: empty file (no CSV header)")

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        try:
            yield from enumerate(reader, start=1)
        finally:
            fh.close()

    return header, rows()


def _pick(
    header: Sequence[str], names: Sequence[str], path: Path, what: str, required: bool = True
) -> str | None:
    for n in names:
        if n in header:
            return n
    if required:
        raise DataError(
            f"{path}: no {what} column; expected one of {list(names)}, found {list(header)}"
        )
    return None


def _float(
    value: object, row: int, name: str, *, lo: float | None = None, hi: float | None = None
) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DataError(f"row {row}: {name} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise DataError(f"row {row}: {name} must be a finite number, got {value!r}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        lo_s = "-inf" if lo is None else f"{lo:g}"
        hi_s = "inf" if hi is None else f"{hi:g}"
        raise DataError(f"row {row}: {name} must be in [{lo_s}, {hi_s}], got {value!r}")
    return x


def _opt_float(value: str | None, row: int, name: str) -> float:
    if value is None or value.strip() == "":
        return math.nan
    return _float(value, row, name, lo=0.0)


def _score(value: object, row: int, name: str = "score") -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DataError(f"row {row}: {name} must be in [0, 1], got {value!r}") from None
    if not (0.0 <= x <= 1.0):
        raise DataError(f"row {row}: {name} must be in [0, 1], got {value!r}")
    return x


def _text(value: str | None, row: int, name: str) -> str:
    if value is None or value.strip() == "":
        raise DataError(f"row {row}: {name} must be a non-empty string, got {value!r}")
    return value


def _table(
    qid: list[str],
    task: list[str],
    text: list[str],
    model: list[str],
    score: list[float],
    prompt: list[float] | None = None,
    out_tok: list[float] | None = None,
    cost: list[float] | None = None,
    extra: list[int] | None = None,
    src: list[int] | None = None,
) -> LongTable:
    k = len(qid)
    nan = np.full(k, np.nan)
    return LongTable(
        query_id=qid,
        task=task,
        text=text,
        model=model,
        score=np.asarray(score, dtype=np.float64),
        prompt_tokens=np.asarray(prompt, dtype=np.float64) if prompt is not None else nan.copy(),
        output_tokens=np.asarray(out_tok, dtype=np.float64) if out_tok is not None else nan.copy(),
        cost_usd=np.asarray(cost, dtype=np.float64) if cost is not None else nan.copy(),
        extra_prompt_chars=np.asarray(extra, dtype=np.int64)
        if extra is not None
        else np.zeros(k, np.int64),
        source_row=np.asarray(src, dtype=np.int64)
        if src is not None
        else np.arange(1, k + 1, dtype=np.int64),
    )


def read_irt_wide(path: str | Path) -> LongTable:
    """``task,id,question,<model>...`` (one score column per model) -> long table."""
    path = Path(path)
    header, rows = _csv_rows(path)
    text_col = _pick(header, _TEXT_COLS, path, "query text")
    assert text_col is not None
    id_col = _pick(header, ("query_id", "id"), path, "query id")
    assert id_col is not None
    has_task = "task" in header
    model_cols = [h for h in header if h not in _IRT_META]
    if not model_cols:
        raise DataError(f"{path}: no model score columns besides {sorted(_IRT_META & set(header))}")
    qid: list[str] = []
    task: list[str] = []
    text: list[str] = []
    model: list[str] = []
    score: list[float] = []
    src: list[int] = []
    for r, row in rows:
        t = row.get("task", "") if has_task else ""
        raw_id = _text(row.get(id_col), r, id_col)
        q = f"{t}:{raw_id}" if has_task and id_col == "id" else raw_id
        txt = _text(row.get(text_col), r, text_col)
        for mc in model_cols:
            v = row.get(mc)
            if v is None or v.strip() == "":
                continue  # not evaluated
            qid.append(q)
            task.append(t or "")
            text.append(txt)
            model.append(mc)
            score.append(_score(v, r, mc))
            src.append(r)
    return _table(qid, task, text, model, score, src=src)


def read_long(path: str | Path) -> LongTable:
    """One row per (query, model); see the module docstring for the accepted columns."""
    path = Path(path)
    header, rows = _csv_rows(path)
    id_col = _pick(header, _ID_COLS, path, "query id")
    text_col = _pick(header, _TEXT_COLS, path, "query text")
    model_col = _pick(header, _MODEL_COLS, path, "model")
    score_col = _pick(header, _SCORE_COLS, path, "score")
    assert id_col and text_col and model_col and score_col
    task_col = _pick(header, ("task", "source"), path, "task", required=False)
    opt = {c: c in header for c in ("prompt_tokens", "output_tokens", "cost_usd", "choices_chars")}
    qid: list[str] = []
    task: list[str] = []
    text: list[str] = []
    model: list[str] = []
    score: list[float] = []
    prompt: list[float] = []
    out_tok: list[float] = []
    cost: list[float] = []
    extra: list[int] = []
    for r, row in rows:
        qid.append(_text(row.get(id_col), r, id_col))
        text.append(_text(row.get(text_col), r, text_col))
        model.append(_text(row.get(model_col), r, model_col).strip())
        score.append(_score(row.get(score_col), r, score_col))
        task.append((row.get(task_col) or "") if task_col else "")
        prompt.append(
            _opt_float(row.get("prompt_tokens"), r, "prompt_tokens")
            if opt["prompt_tokens"]
            else math.nan
        )
        out_tok.append(
            _opt_float(row.get("output_tokens"), r, "output_tokens")
            if opt["output_tokens"]
            else math.nan
        )
        cost.append(_opt_float(row.get("cost_usd"), r, "cost_usd") if opt["cost_usd"] else math.nan)
        if opt["choices_chars"]:
            c = _opt_float(row.get("choices_chars"), r, "choices_chars")
            extra.append(0 if math.isnan(c) else int(c))
        else:
            extra.append(0)
    return _table(qid, task, text, model, score, prompt, out_tok, cost, extra)


def read_nq_records(path: str | Path, prices: ModelPrices | None = None) -> LongTable:
    """``llmrouter_nq6`` JSON Lines: align lists by model name, never by position.

    ``cost`` in the source is micro-USD (README: cost / USD-per-1M price is an integer
    token count for every row); with ``prices`` the output tokens are recovered as
    ``cost / (output_usd_per_token * 1e6)``.
    """
    path = Path(path)
    price_idx = prices.index() if prices else {}
    qid: list[str] = []
    task: list[str] = []
    text: list[str] = []
    model: list[str] = []
    score: list[float] = []
    out_tok: list[float] = []
    cost: list[float] = []
    src: list[int] = []
    with _open_text(path) as fh:
        for r, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"row {r}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise DataError(f"row {r}: expected a JSON object, got {type(rec).__name__}")
            for key in ("q_id", "query", "llm_name_list", "perf_list"):
                if key not in rec:
                    raise DataError(f"row {r}: {key} is required")
            names = rec["llm_name_list"]
            perfs = rec["perf_list"]
            costs = rec.get("cost_list")
            if (
                not isinstance(names, list)
                or not isinstance(perfs, list)
                or len(names) != len(perfs)
            ):
                raise DataError(
                    f"row {r}: llm_name_list and perf_list must be lists of equal length"
                )
            if costs is not None and (not isinstance(costs, list) or len(costs) != len(names)):
                raise DataError(f"row {r}: cost_list must be a list as long as llm_name_list")
            q = str(rec["q_id"])
            txt = _text(rec["query"] if isinstance(rec["query"], str) else None, r, "query")
            for k, name in enumerate(names):
                if not isinstance(name, str) or not name:
                    raise DataError(
                        f"row {r}: llm_name_list[{k}] must be a model name, got {name!r}"
                    )
                src.append(r)
                qid.append(q)
                task.append(str(rec.get("source", "")))
                text.append(txt)
                model.append(name)
                score.append(_score(perfs[k], r, f"perf_list[{k}]"))
                c_micro = (
                    math.nan if costs is None else _float(costs[k], r, f"cost_list[{k}]", lo=0.0)
                )
                cost.append(c_micro * 1e-6)
                j = price_idx.get(name)
                if j is not None and prices is not None and not math.isnan(c_micro):
                    per_token = float(prices.output_usd_per_token[j])
                    out_tok.append(c_micro * 1e-6 / per_token if per_token > 0 else math.nan)
                else:
                    out_tok.append(math.nan)
    if not qid:
        raise DataError(f"{path}: no records")
    return _table(qid, task, text, model, score, None, out_tok, cost, src=src)


def read_models_csv(path: str | Path) -> ModelPrices:
    """Per-model prices. Accepts ``input_usd_per_token``/``output_usd_per_token``,
    ``input_price_per_1m_usd``/``output_price_per_1m_usd`` or
    ``input_usd_per_1M_tokens``/``output_usd_per_1M_tokens``."""
    path = Path(path)
    header, rows = _csv_rows(path)
    _pick(header, ("model",), path, "model")
    schemes = (
        ("input_usd_per_token", "output_usd_per_token", 1.0),
        ("input_price_per_1m_usd", "output_price_per_1m_usd", 1e-6),
        ("input_usd_per_1M_tokens", "output_usd_per_1M_tokens", 1e-6),
    )
    picked = next((sc for sc in schemes if sc[0] in header and sc[1] in header), None)
    if picked is None:
        raise DataError(
            f"{path}: no price columns; expected one of {[s[:2] for s in schemes]}, found {header}"
        )
    cin, cout, scale = picked
    models: list[str] = []
    pin: list[float] = []
    pout: list[float] = []
    seen: set[str] = set()
    for r, row in rows:
        name = _text(row.get("model"), r, "model").strip()
        if name in seen:
            raise DataError(f"{path} row {r}: model {name!r} is listed twice")
        seen.add(name)
        models.append(name)
        pin.append(_float(row.get(cin), r, cin, lo=0.0) * scale)
        pout.append(_float(row.get(cout), r, cout, lo=0.0) * scale)
    return ModelPrices(
        models, np.asarray(pin, dtype=np.float64), np.asarray(pout, dtype=np.float64)
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


def load_routing_data(
    path: str | Path, format: DataFormat | str, models_csv: str | Path | None = None
) -> RoutingData:
    """Read one source into the wide view.

    ``models_csv`` defaults to ``models.csv`` beside the data file when one exists;
    without prices the price arrays are ``nan`` (quality-only use).
    """
    path = Path(path)
    if format not in FORMATS:
        raise DataError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")
    if models_csv is None and (path.parent / "models.csv").exists():
        models_csv = path.parent / "models.csv"
    prices = read_models_csv(models_csv) if models_csv is not None else None
    if format == "irt-wide":
        long = read_irt_wide(path)
    elif format == "long":
        long = read_long(path)
    else:
        long = read_nq_records(path, prices)
    data = to_wide(long, prices, source=str(path))
    if format == "nq-records":
        data.meta["cost_note"] = "realised cost from the data (micro-USD, output tokens only)"
    else:
        data.meta["cost_note"] = (
            f"estimated: prompt tokens from text, {DEFAULT_OUTPUT_TOKENS:g} output tokens"
        )
    return data


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
