"""Routing data files: one reader per source into a ``LongTable``, then the wide view.

Sources (see ``data/routing/README.md``):

- ``irt-wide``: one row per query, one score column per model (``irt_router_ccf20``);
- ``long``: one row per (query, model) (``llmrouter_dc9`` ``scores_long.csv.gz``, or any
  CSV with ``query_id|query_hash|q_id``, ``text|query|question``, ``model|llm_name``,
  ``score|perf`` and optional ``task``, ``prompt_tokens``, ``output_tokens``,
  ``cost_usd``, ``choices_chars``);
- ``nq-records``: ``llmrouter_nq6`` JSON Lines with per-model responses and a real cost
  in micro-USD (output tokens = cost / price per 1M tokens).

The in-memory types, the pivot and the splits are pure and live in ``routing.datasets``;
file reading (gzip, CSV, JSON Lines) lives here.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from routing.datasets import (
    DEFAULT_OUTPUT_TOKENS,
    FORMATS,
    DataError,
    DataFormat,
    LongTable,
    ModelPrices,
    RoutingData,
    to_wide,
)

_ID_COLS = ("query_id", "query_hash", "q_id", "id")
_TEXT_COLS = ("text", "query", "question", "prompt")
_MODEL_COLS = ("model", "llm_name")
_SCORE_COLS = ("score", "perf")
_IRT_META = {"task", "id", "query_id", "question", "query", "text", "prompt", "split"}


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
