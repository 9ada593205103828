"""Step timings measured on a real vLLM engine: read, fit Eq. 9 and a table, write a profile.

``switchyard profile-vllm`` drives vLLM's engine step by step (``services/vllm/profile_steps.py``
runs inside the engine's own venv) and writes one JSON line per step: its wall time and what
the scheduler put in it, per request the tokens scheduled this step and the tokens already
computed (its context). This module is the pure half: it turns those steps into

* Eq. 9 coefficients (``routing.steptime.fit_nnls``, NNLS on relative error), with the fit
  error per step (MAPE, p90, max) overall and by step kind (decode, prefill, mixed);
* a measured table (``routing.profiles.Table``) for the simulated engine: the dense term
  piecewise linear in the batch's tokens (NNLS on hat functions at geometric knots) plus
  per-sequence, per-decode, KV-read and prefill-attention terms, fitted on the same steps;
* a profile record in the ``data/profiles/profiles.json`` format, with its provenance.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.optimize import nnls

from routing.profiles import Table, attn_eff_units
from routing.steptime import FitReport, StepTimeModel, attn_units, features, fit_nnls

FloatArray = npt.NDArray[np.float64]

KINDS = ("decode", "prefill", "mixed")
HALF_EFF_CHOICES = (0.0, 16.0, 32.0, 64.0, 128.0, 256.0)  # prefill-attention efficiency knee
STEPS_FORMAT = "switchyard-vllm-steps/1"
MAX_BACKGROUND_TOKENS = 8192  # per experiment: decodes x ctx (their prefill is most of the time)
OUTLIER_FACTOR = 2.0  # a step over 2x its first-fit prediction counts as a stall


@dataclass(frozen=True)
class Step:
    """One engine step: wall time and, per scheduled request, (new tokens, context tokens)."""

    step_ms: float
    decodes: tuple[int, ...]  # context (tokens already computed) of each decode
    chunks: tuple[tuple[int, int], ...]  # (new tokens, context) of each prefill chunk

    @property
    def kind(self) -> str:
        if not self.chunks:
            return "decode"
        return "prefill" if not self.decodes else "mixed"

    @property
    def n_tokens(self) -> int:
        return len(self.decodes) + sum(q for q, _ in self.chunks)

    @property
    def n_seqs(self) -> int:
        return len(self.decodes) + len(self.chunks)


def step_from_json(obj: dict[str, Any], where: str = "step") -> Step:
    """A step from the driver's JSON line ``{"ms": .., "reqs": [[new, ctx, prompt_len], ..]}``.

    A request counts as a decode when it gets one token and its context has reached its prompt
    length; otherwise its tokens are a prefill chunk.
    """
    try:
        ms = float(obj["ms"])
        reqs = obj["reqs"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: need keys 'ms' and 'reqs', got {obj!r:.200}") from exc
    if not np.isfinite(ms) or ms <= 0:
        raise ValueError(f"{where}: step time must be a finite number > 0 ms, got {ms}")
    if not isinstance(reqs, list) or not reqs:
        raise ValueError(f"{where}: 'reqs' must be a non-empty list of [new, ctx, prompt_len]")
    decodes: list[int] = []
    chunks: list[tuple[int, int]] = []
    for r in reqs:
        if not isinstance(r, list) or len(r) != 3 or not all(isinstance(v, int) for v in r):
            raise ValueError(
                f"{where}: each request must be [new, ctx, prompt_len] ints, got {r!r}"
            )
        new, ctx, prompt = r
        if new < 1 or ctx < 0 or prompt < 1:
            raise ValueError(f"{where}: request {r!r} needs new >= 1, ctx >= 0, prompt_len >= 1")
        if new == 1 and ctx >= prompt:
            decodes.append(ctx)
        else:
            chunks.append((new, ctx))
    return Step(ms, tuple(decodes), tuple(chunks))


def read_steps(path: Path) -> tuple[dict[str, Any], list[Step]]:
    """The driver's output: a header line (``{"format": .., "provenance": ..}``), then steps.

    ``.gz`` files are read gunzipped. Warm-up steps are skipped.
    """
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    lines = [ln for ln in raw.decode("utf-8").splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty; expected the output of `switchyard profile-vllm`")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:1: not JSON ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != STEPS_FORMAT:
        raise ValueError(f"{path}:1: expected a header with format {STEPS_FORMAT!r}")
    steps = []
    for i, ln in enumerate(lines[1:], start=2):
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i}: not JSON ({exc})") from exc
        if isinstance(obj, dict) and obj.get("warmup"):
            continue
        steps.append(step_from_json(obj, f"{path}:{i}"))
    return header, steps


@dataclass(frozen=True)
class StepArrays:
    """Column view of steps (what both fits use)."""

    step_ms: FloatArray
    n_tokens: FloatArray
    n_seqs: FloatArray
    n_decode: FloatArray
    decode_ctx: FloatArray
    kinds: npt.NDArray[np.str_]
    chunks: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def of(cls, steps: Sequence[Step]) -> StepArrays:
        if not steps:
            raise ValueError("no steps to fit")
        return cls(
            step_ms=np.array([s.step_ms for s in steps], dtype=np.float64),
            n_tokens=np.array([s.n_tokens for s in steps], dtype=np.float64),
            n_seqs=np.array([s.n_seqs for s in steps], dtype=np.float64),
            n_decode=np.array([len(s.decodes) for s in steps], dtype=np.float64),
            decode_ctx=np.array([sum(s.decodes) for s in steps], dtype=np.float64),
            kinds=np.array([s.kind for s in steps]),
            chunks=tuple(s.chunks for s in steps),
        )

    def attn(self) -> FloatArray:
        return np.array(
            [sum(float(attn_units(q, c)) for q, c in ch) for ch in self.chunks], dtype=np.float64
        )

    def attn_eff(self, half_eff_tokens: float) -> FloatArray:
        return np.array(
            [
                sum(float(attn_eff_units(q, c, half_eff_tokens)) for q, c in ch)
                for ch in self.chunks
            ],
            dtype=np.float64,
        )


def merge_repeats(steps: Sequence[Step]) -> tuple[list[Step], int]:
    """One step per distinct batch composition, at the median of its measured times.

    A sweep run ``reps`` times schedules the same batches each time; the median of their
    times leaves out a burst of contention that hit one repetition. Returns the merged steps
    (first-seen order) and how many compositions were measured more than once.
    """
    groups: dict[tuple[tuple[int, ...], tuple[tuple[int, int], ...]], list[float]] = {}
    for s in steps:
        groups.setdefault((s.decodes, s.chunks), []).append(s.step_ms)
    merged = [Step(float(np.median(v)), k[0], k[1]) for k, v in groups.items()]
    return merged, sum(1 for v in groups.values() if len(v) > 1)


def error_stats(ape: FloatArray, kinds: npt.NDArray[np.str_]) -> dict[str, Any]:
    """MAPE, p90 and max APE overall and by step kind (fractions, rounded)."""

    def one(a: FloatArray) -> dict[str, Any]:
        return {
            "steps": int(a.size),
            "mape": round(float(a.mean()), 4),
            "p90_ape": round(float(np.quantile(a, 0.9)), 4),
            "max_ape": round(float(a.max()), 4),
        }

    out = one(ape)
    out["by_kind"] = {k: one(ape[kinds == k]) for k in KINDS if (kinds == k).any()}
    return out


def fit_eq9(arr: StepArrays) -> tuple[FitReport, FloatArray]:
    """Eq. 9 by NNLS on relative error; also each step's absolute percentage error."""
    X = features(arr.n_tokens, arr.decode_ctx, arr.attn())
    rep = fit_nnls(X, arr.step_ms)
    ape = np.asarray(np.abs(X @ rep.model.coef - arr.step_ms) / arr.step_ms, dtype=np.float64)
    return rep, ape


def stall_mask(arr: StepArrays, factor: float = OUTLIER_FACTOR) -> npt.NDArray[np.bool_]:
    """Steps slower than ``factor`` x what a first Eq. 9 fit predicts (the process was
    descheduled: on a shared machine a step can stall for a scheduler quantum or more)."""
    rep, _ = fit_eq9(arr)
    X = features(arr.n_tokens, arr.decode_ctx, arr.attn())
    out: npt.NDArray[np.bool_] = arr.step_ms > factor * (X @ rep.model.coef)
    return out


def subset(arr: StepArrays, keep: npt.NDArray[np.bool_]) -> StepArrays:
    return StepArrays(
        step_ms=arr.step_ms[keep],
        n_tokens=arr.n_tokens[keep],
        n_seqs=arr.n_seqs[keep],
        n_decode=arr.n_decode[keep],
        decode_ctx=arr.decode_ctx[keep],
        kinds=arr.kinds[keep],
        chunks=tuple(c for c, k in zip(arr.chunks, keep, strict=True) if k),
    )


def dense_knots(n_tokens: FloatArray, count: int = 10) -> FloatArray:
    """Geometric knots from 1 to the largest batch, each with steps on its span."""
    hi = max(2.0, float(n_tokens.max()))
    knots = np.unique(np.round(np.geomspace(1.0, hi, count)))
    return np.asarray(knots, dtype=np.float64)


def _hat_basis(x: FloatArray, knots: FloatArray) -> FloatArray:
    """Piecewise-linear interpolation weights of ``x`` on ``knots`` (clamped at the ends)."""
    B = np.zeros((x.size, knots.size))
    xc = np.clip(x, knots[0], knots[-1])
    i = np.clip(np.searchsorted(knots, xc, side="right") - 1, 0, knots.size - 2)
    x0, x1 = knots[i], knots[i + 1]
    w = (xc - x0) / (x1 - x0)
    rows = np.arange(x.size)
    B[rows, i] = 1.0 - w
    B[rows, i + 1] += w
    return B


def fit_table(arr: StepArrays) -> tuple[Table, FloatArray]:
    """The simulated engine's table fitted on measured steps (NNLS, relative error).

    Unknowns: the dense term at each knot (it carries the fixed per-step cost), per sequence,
    per decode, per decode-context token and per prefill-attention unit; the prefill
    efficiency knee is chosen from :data:`HALF_EFF_CHOICES` by the lowest MAPE.
    """
    knots = dense_knots(arr.n_tokens)
    B = _hat_basis(arr.n_tokens, knots)
    y = arr.step_ms
    w = 1.0 / y
    best: tuple[float, Table, FloatArray] | None = None
    for half in HALF_EFF_CHOICES:
        A = np.column_stack([B, arr.n_seqs, arr.n_decode, arr.decode_ctx, arr.attn_eff(half)])
        Aw = A * w[:, None]
        scale = np.abs(Aw).max(axis=0)
        scale[scale == 0] = 1.0
        theta, _ = nnls(Aw / scale, y * w, maxiter=50 * A.shape[1])
        theta = theta / scale
        pred = A @ theta
        ape = np.asarray(np.abs(pred - y) / y, dtype=np.float64)
        k = knots.size
        table = Table(
            dense_tokens=knots,
            dense_ms=np.asarray(theta[:k], dtype=np.float64),
            cpu_ms=0.0,
            cpu_ms_per_seq=float(theta[k]),
            decode_ms_per_seq=float(theta[k + 1]),
            decode_ms_per_ctx_token=float(theta[k + 2]),
            prefill_ms_per_attn_unit=float(theta[k + 3]),
            prefill_half_eff_tokens=half,
        )
        if best is None or ape.mean() < best[0]:
            best = (float(ape.mean()), table, ape)
    assert best is not None
    return best[1], best[2]


def table_step_ms(table: Table, arr: StepArrays) -> FloatArray:
    """The table's price of each measured step (what the simulated engine would charge)."""
    return table.step_ms(
        arr.n_tokens,
        arr.n_seqs,
        arr.n_decode,
        arr.decode_ctx,
        arr.attn_eff(table.prefill_half_eff_tokens),
    )


def _r(v: float, digits: int = 8) -> float:
    return float(f"{v:.{digits}g}")


def profile_record(steps: Sequence[Step], header: dict[str, Any], note: str = "") -> dict[str, Any]:
    """A ``profiles.json`` record fitted on ``steps`` (header: the driver's provenance)."""
    if len(steps) < 8:
        raise ValueError(f"need at least 8 measured steps to fit, got {len(steps)}")
    merged, repeated = merge_repeats(steps)
    every = StepArrays.of(merged)
    stalls = stall_mask(every)
    arr = subset(every, ~stalls)
    rep, ape = fit_eq9(arr)
    table, ape_t = fit_table(arr)
    X_all = features(every.n_tokens, every.decode_ctx, every.attn())
    ape_all = np.asarray(
        np.abs(X_all @ rep.model.coef - every.step_ms) / every.step_ms, dtype=np.float64
    )
    m: StepTimeModel = rep.model
    prov = dict(header.get("provenance", {}))
    shape = dict(header.get("shape", {}))
    counts = {k: int((arr.kinds == k).sum()) for k in KINDS}
    return {
        "model": str(header.get("model", "")),
        "gpu": str(header.get("device", "cpu")),
        "tensor_parallel": 1,
        "layers": int(shape.get("num_hidden_layers", 0)),
        "shape": shape,
        "note": note or "measured on a real vLLM engine by `switchyard profile-vllm`",
        "kv_blocks": int(header.get("kv_blocks", 0)),
        "block_size_tokens": int(header.get("block_size_tokens", 16)),
        "coefficients": {
            "c0_ms": _r(m.c0_ms),
            "c1_ms_per_token": _r(m.c1_ms_per_token),
            "c2_ms_per_ctx_token": _r(m.c2_ms_per_ctx_token),
            "c3_ms_per_attn_unit": _r(m.c3_ms_per_attn_unit),
        },
        "fit": {
            "method": "NNLS, relative error, on measured engine steps (stalls left out)",
            "measured_steps": len(steps),
            "compositions": len(merged),
            "compositions_repeated": repeated,
            "stalls_left_out": int(stalls.sum()),
            "stall_rule": f"step time > {OUTLIER_FACTOR:g} x a first Eq. 9 fit's prediction",
            "eq9_all_steps": error_stats(ape_all, every.kinds),
            "rows": rep.n_rows,
            "mape": round(rep.mape, 4),
            "p90_ape": round(rep.p90_ape, 4),
            "max_ape": round(rep.max_ape, 4),
            "eq9": error_stats(ape, arr.kinds),
            "table": error_stats(ape_t, arr.kinds),
            "steps_by_kind": counts,
            "median_step_ms": {
                k: round(float(np.median(arr.step_ms[arr.kinds == k])), 3)
                for k in KINDS
                if counts[k]
            },
        },
        "table": {
            "dense_tokens": [float(v) for v in table.dense_tokens],
            "dense_ms": [_r(float(v), 6) for v in table.dense_ms],
            "cpu_ms": table.cpu_ms,
            "cpu_ms_per_seq": _r(table.cpu_ms_per_seq, 6),
            "decode_ms_per_seq": _r(table.decode_ms_per_seq, 6),
            "decode_ms_per_ctx_token": _r(table.decode_ms_per_ctx_token, 6),
            "prefill_ms_per_attn_unit": _r(table.prefill_ms_per_attn_unit, 6),
            "prefill_half_eff_tokens": table.prefill_half_eff_tokens,
            "dense_source": "fitted on the measured steps (NNLS on hat functions at the knots)",
        },
        "provenance": prov,
    }


def steps_text(header: dict[str, Any], rows: Iterable[dict[str, Any]]) -> str:
    """The steps file format (header line, one JSON object per step)."""
    out = [json.dumps({**header, "format": STEPS_FORMAT}, sort_keys=True)]
    out += [json.dumps(r, separators=(",", ":")) for r in rows]
    return "\n".join(out) + "\n"


def sweep_plan(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    *,
    quick: bool = False,
    reps: int = 3,
    decode_steps: int = 6,
) -> list[dict[str, int]]:
    """Batch compositions the driver builds, one experiment each.

    An experiment starts ``decodes`` requests of ``ctx`` prompt tokens (their prefill steps are
    measured too), runs ``decode_steps`` pure-decode steps, then adds one request of
    ``prefill`` prompt tokens (0: none) beside them (a mixed step, or a prefill-only one when
    ``decodes`` is 0; a prompt over the token budget is chunked on its own context) and ends
    when that prompt is prefilled. Every step is recorded with what was scheduled in it.
    """
    for name, v in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
        ("reps", reps),
        ("decode_steps", decode_steps),
    ):
        if v < 1:
            raise ValueError(f"sweep_plan: {name} must be >= 1, got {v}")
    top_ctx = max_model_len - decode_steps - 17  # the driver asks decode_steps + 16 tokens
    if top_ctx < 16:
        raise ValueError(f"sweep_plan: max_model_len {max_model_len} is too small to profile")

    def ctxs(values: Iterable[int]) -> list[int]:
        return sorted({min(v, top_ctx) for v in values})

    def seqs(values: Iterable[int]) -> list[int]:
        return sorted({min(v, max_num_seqs) for v in values})

    B = max_num_batched_tokens
    plan: list[dict[str, int]] = []
    if quick:
        prefills = sorted({16, min(max_model_len - 2, 2 * B)})
        plan += [{"decodes": 0, "ctx": 0, "prefill": q} for q in prefills]
        plan.append({"decodes": 1, "ctx": ctxs((64,))[0], "prefill": 0})
        plan.append({"decodes": max_num_seqs, "ctx": ctxs((64,))[0], "prefill": max(1, B // 4)})
        reps = 1
    else:
        prefill_sizes = {16, 32, 64, 128, 256, 384, B // 2, B, 2 * B, 3 * B, max_model_len - 2}
        prefills = sorted({min(q, max_model_len - 2) for q in prefill_sizes if q >= 1})
        plan += [{"decodes": 0, "ctx": 0, "prefill": q} for q in prefills]
        for n in seqs((1, 2, 4, 8, 16, max_num_seqs)):
            for c in ctxs((32, 256, 1024, top_ctx)):
                if n * c <= max(MAX_BACKGROUND_TOKENS, c):  # prefilling them costs the most
                    plan.append({"decodes": n, "ctx": c, "prefill": 0})
        for n in seqs((1, 4, 8, max_num_seqs - 1)):
            if n >= max_num_seqs:
                continue
            for q in sorted({32, 128, max(1, B - n)}):
                plan.append({"decodes": n, "ctx": ctxs((512,))[0], "prefill": q})
    return [dict(e, decode_steps=decode_steps) for _ in range(reps) for e in plan]


def refit_measured(profiles: dict[str, Any], steps_dir: Path) -> dict[str, Any]:
    """Measured profiles of ``profiles`` (records with ``provenance.steps_file``), re-fitted
    from their steps files in ``steps_dir`` (``switchyard profiles build`` keeps them)."""
    out: dict[str, Any] = {}
    for name, rec in profiles.items():
        steps_file = rec.get("provenance", {}).get("steps_file")
        if not steps_file:
            continue
        path = steps_dir / steps_file
        if not path.is_file():
            raise FileNotFoundError(f"profile {name}: its steps file {path} is missing")
        header, steps = read_steps(path)
        new = profile_record(steps, header, note=str(rec.get("note", "")))
        new["provenance"]["steps_file"] = steps_file
        out[name] = new
    return out
