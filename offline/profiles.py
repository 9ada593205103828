"""Step-time profile building and SFS validation against real vLLM request logs (offline).

Reads CSV files (vendored under ``data/profiles`` or from a shared data folder), builds the
dense tables, fits Eq. 9 per profile (``routing.profiles`` holds the table and
``loaders.profiles`` reads the file), and replays real vLLM request logs through the simulated engine and SFS
(``switchyard profiles build`` and ``switchyard validate-ttft`` are thin shells over this).
"""

from __future__ import annotations

import csv
import gzip
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.profiles import Table, attn_eff_units, dense_interp
from routing.steptime import FitReport, StepTimeModel, attn_units, features, fit_nnls

FloatArray = npt.NDArray[np.float64]

# ---- profile specs -------------------------------------------------------------------------

HBM_BYTES_PER_S = 3.35e12 * 0.7  # H100 SXM HBM3, ~70% achievable
ATTN_FLOPS_PER_S = 989e12 * 0.5  # H100 dense bf16, ~50% for FlashAttention
HALF_EFF_TOKENS = 128.0  # prefill attention kernel reaches half its peak at 128-token chunks
GPU_MEM_BYTES = 85.52e9  # 80 GiB
GPU_MEM_UTIL = 0.9  # vLLM default gpu_memory_utilization
ACT_RESERVE_BYTES = 1.4e9  # per GPU; reproduces CodeLlama-34B's logged 2537 KV blocks


@dataclass(frozen=True)
class Spec:
    name: str
    vidur_dir: str  # under ../shared/data/profiles/vidur/
    layers: int
    tp: int
    params: float
    calibrate: str  # "vllm-run", "splitwise" or "borrow:<profile>"
    decode_ms_per_seq_prior: float  # BLIS beta2 (vLLM per-decode-token cost) where published
    note: str = ""


SPECS = (
    Spec(
        "llama-2-7b-hf@h100",
        "h100/Llama-2-7b-hf",
        32,
        1,
        6.74e9,
        "vllm-run",
        0.025,
        "7-8B tier; calibrated on a real vLLM 0.11 run (inference-sim)",
    ),
    Spec(
        "internlm-20b@h100",
        "h100/internlm-20b",
        60,
        1,
        20.0e9,
        "borrow:codellama-34b-instruct-hf@h100",
        0.04,
        "20B tier; Vidur dense tables, calibration scalars borrowed from codellama-34b",
    ),
    Spec(
        "codellama-34b-instruct-hf@h100",
        "h100/CodeLlama-34b-Instruct-hf",
        48,
        1,
        33.7e9,
        "vllm-run",
        0.0566,
        "34B tier; calibrated on a real vLLM 0.11 run (inference-sim)",
    ),
    Spec(
        "llama-2-70b-hf@h100",
        "h100/Llama-2-70b-hf",
        80,
        4,
        69.0e9,
        "splitwise",
        0.0,
        "70B tier, TP4; calibrated on Splitwise DGX-H100 measurements",
    ),
    Spec(
        "qwen-72b@h100",
        "h100/Qwen-72B",
        80,
        4,
        72.3e9,
        "borrow:llama-2-70b-hf@h100",
        0.0,
        "72B tier, TP4; calibration scalars borrowed from llama-2-70b",
    ),
)

VLLM_RUN_SCHED = {"max_num_batched_tokens": 4096, "max_num_seqs": 256}
VIDUR_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


def _vidur_dense(
    path: Path, layers: int, tp: int
) -> tuple[list[float], list[float], dict[str, int]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["num_tensor_parallel_workers"]) == tp]
    by_n: dict[int, list[float]] = {}
    for r in rows:  # a few token counts were profiled twice: keep their median
        t = layers * sum(float(r[f"time_stats.{op}.median"]) for op in VIDUR_OPS)
        by_n.setdefault(int(r["num_tokens"]), []).append(t + float(r["time_stats.emb.median"]))
    n = [float(k) for k in sorted(by_n)]
    ms = [round(float(np.median(by_n[k])), 5) for k in sorted(by_n)]
    shape = {
        k: int(float(rows[0][k]))
        for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")
    }
    return n, ms, shape


def _priors(shape: dict[str, int], layers: int, tp: int) -> tuple[float, float, float]:
    head_dim = shape["n_embd"] // shape["n_head"]
    kv_bytes_per_token = 2 * layers * shape["n_kv_head"] * head_dim * 2  # K and V, 2 bytes each
    kv_ms = kv_bytes_per_token / tp / HBM_BYTES_PER_S * 1e3
    attn_ms = 4.0 * layers * shape["n_head"] * head_dim / tp / ATTN_FLOPS_PER_S * 1e3
    return kv_ms, attn_ms, float(kv_bytes_per_token)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _alone_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Requests that overlapped no other request (guidellm's synchronous pass), minus warm-up."""
    a = np.array([float(r["arrival_unix_s"]) for r in rows])
    e = np.array([float(r["end_unix_s"]) for r in rows])
    out = []
    for i in range(1, len(rows)):  # row 0 is the engine's cold start
        overlap = (a < e[i]) & (e > a[i])
        overlap[i] = False
        if not overlap.any():
            out.append(rows[i])
    return out


def _obs_vllm_run(
    rows: list[dict[str, str]], dense: Any, budget: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Observations (features per step-sum, measured ms): [1, dense, n_decode, sum ctx, attn_eff]."""

    X, y, kind = [], [], []
    for r in _alone_rows(rows):
        P, n_out = int(r["input_tokens"]), int(r["output_tokens"])
        f = np.zeros(5)
        done = 0
        while done < P:
            q = min(budget, P - done)
            f += [1.0, float(dense(q)), 0.0, 0.0, float(attn_eff_units(q, done, HALF_EFF_TOKENS))]
            done += q
        X.append(f)
        y.append(float(r["prefill_s"]) * 1e3)
        kind.append("prefill")
        if n_out > 2:
            ctx = P + (n_out - 2) / 2.0
            X.append(np.array([1.0, float(dense(1)), 1.0, ctx, 0.0]))
            y.append(float(r["decode_s"]) / (n_out - 1) * 1e3)
            kind.append("decode")
    return np.array(X), np.array(y), kind


def _obs_splitwise(
    rows: list[dict[str, str]], dense: Any, tp: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:

    groups: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    for r in rows:
        if int(r["tensor_parallel"]) != tp:
            continue
        key = (int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"]))
        groups.setdefault(key, []).append((float(r["prompt_time"]), float(r["token_time"])))
    X, y, kind = [], [], []
    for (p, b, t), vals in sorted(groups.items()):
        pt = float(np.median([v[0] for v in vals]))
        tt = float(np.median([v[1] for v in vals]))
        X.append(
            np.array(
                [
                    1.0,
                    float(dense(b * p)),
                    0.0,
                    0.0,
                    b * float(attn_eff_units(p, 0, HALF_EFF_TOKENS)),
                ]
            )
        )
        y.append(pt)
        kind.append("prefill")
        X.append(np.array([1.0, float(dense(b)), float(b), b * (p + t / 2.0), 0.0]))
        y.append(tt)
        kind.append("decode")
    return np.array(X), np.array(y), kind


def build_profiles(data_dir: Path, dense_tables: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Calibrate each profile's table on real timings, fit Eq. 9 on it; return profiles.json."""
    from scipy.optimize import nnls

    out: dict[str, Any] = {}
    calibrated: dict[str, dict[str, float]] = {}
    for spec in sorted(SPECS, key=lambda s: s.calibrate.startswith("borrow")):
        dt = dense_tables[spec.name]
        x = np.asarray(dt["dense_tokens"], dtype=np.float64)
        yd = np.asarray(dt["dense_ms"], dtype=np.float64)
        kv_ms, attn_ms, kv_bytes = _priors(dt["shape"], spec.layers, spec.tp)

        def dense(n: float, x: np.ndarray = x, yd: np.ndarray = yd) -> float:
            return float(dense_interp(x, yd, n))

        obs_X = obs_y = None
        kinds: list[str] = []
        source = ""
        if spec.calibrate == "vllm-run":
            path = data_dir / "vllm-runs" / f"{spec.name}.csv"
            obs_X, obs_y, kinds = _obs_vllm_run(
                _read_csv(path), dense, VLLM_RUN_SCHED["max_num_batched_tokens"]
            )
            source = f"vllm-runs/{spec.name}.csv (requests that ran alone)"
            # unknowns: cpu_ms, dense scale, attention scale; per-seq and KV priors fixed
            fixed = spec.decode_ms_per_seq_prior * obs_X[:, 2] + kv_ms * obs_X[:, 3]
            A = np.column_stack([obs_X[:, 0], obs_X[:, 1], attn_ms * obs_X[:, 4]])
            w = 1.0 / obs_y
            theta, _ = nnls(A * w[:, None], (obs_y - fixed) * w)
            cal = {
                "cpu_ms": theta[0],
                "dense_scale": theta[1],
                "decode_ms_per_seq": spec.decode_ms_per_seq_prior,
                "kv_scale": 1.0,
                "attn_scale": theta[2],
            }
        elif spec.calibrate == "splitwise":
            path = data_dir / "splitwise" / "llama2-70b-h100-80gb.csv"
            obs_X, obs_y, kinds = _obs_splitwise(_read_csv(path), dense, spec.tp)
            source = f"splitwise/llama2-70b-h100-80gb.csv (TP{spec.tp} medians)"
            A = np.column_stack(
                [obs_X[:, 0], obs_X[:, 1], obs_X[:, 2], kv_ms * obs_X[:, 3], attn_ms * obs_X[:, 4]]
            )
            w = 1.0 / obs_y
            theta, _ = nnls(A * w[:, None], obs_y * w)
            cal = {
                "cpu_ms": theta[0],
                "dense_scale": theta[1],
                "decode_ms_per_seq": theta[2],
                "kv_scale": theta[3],
                "attn_scale": theta[4],
            }
        else:
            donor = spec.calibrate.split(":", 1)[1]
            cal = dict(calibrated[donor])
            source = f"borrowed from {donor}"
        calibrated[spec.name] = cal
        table = Table(
            dense_tokens=x,
            dense_ms=yd * cal["dense_scale"],
            cpu_ms=float(cal["cpu_ms"]),
            cpu_ms_per_seq=0.0,
            decode_ms_per_seq=float(cal["decode_ms_per_seq"]),
            decode_ms_per_ctx_token=float(kv_ms * cal["kv_scale"]),
            prefill_ms_per_attn_unit=float(attn_ms * cal["attn_scale"]),
            prefill_half_eff_tokens=HALF_EFF_TOKENS,
        )
        usable = (
            GPU_MEM_UTIL * GPU_MEM_BYTES * spec.tp - 2.0 * spec.params - ACT_RESERVE_BYTES * spec.tp
        )
        kv_blocks = int(usable / kv_bytes // 16)
        design: Design = fit_design(8192, 256, HALF_EFF_TOKENS)
        rep = fit_on_table(table, design)
        m = rep.model
        real: dict[str, Any] = {}
        if obs_X is not None and obs_y is not None:
            # table and Eq. 9 against the real observations
            t_table = (
                table.cpu_ms * obs_X[:, 0]
                + cal["dense_scale"] * obs_X[:, 1]
                + table.decode_ms_per_seq * obs_X[:, 2]
                + table.decode_ms_per_ctx_token * obs_X[:, 3]
                + table.prefill_ms_per_attn_unit * obs_X[:, 4]
            )
            ape_t = np.abs(t_table - obs_y) / obs_y
            real = {
                "source": source,
                "rows": int(obs_y.size),
                "table_mape": round(float(ape_t.mean()), 4),
                "table_mape_prefill": round(float(ape_t[np.array(kinds) == "prefill"].mean()), 4),
                "table_mape_decode": round(float(ape_t[np.array(kinds) == "decode"].mean()), 4),
            }
        usable = (
            GPU_MEM_UTIL * GPU_MEM_BYTES * spec.tp - 2.0 * spec.params - ACT_RESERVE_BYTES * spec.tp
        )
        kv_blocks = int(usable / kv_bytes // 16)
        out[spec.name] = {
            "model": spec.vidur_dir.split("/", 1)[1],
            "gpu": "h100",
            "tensor_parallel": spec.tp,
            "layers": spec.layers,
            "shape": dt["shape"],
            "note": spec.note,
            "kv_blocks": kv_blocks,
            "block_size_tokens": 16,
            "coefficients": {
                "c0_ms": m.c0_ms,
                "c1_ms_per_token": m.c1_ms_per_token,
                "c2_ms_per_ctx_token": m.c2_ms_per_ctx_token,
                "c3_ms_per_attn_unit": m.c3_ms_per_attn_unit,
            },
            "fit": {
                "method": "NNLS, relative error, on table-priced steps (decode-only, prefill-only, mixed)",
                "rows": rep.n_rows,
                "mape": round(rep.mape, 4),
                "p90_ape": round(rep.p90_ape, 4),
                "max_ape": round(rep.max_ape, 4),
                "real": real,
            },
            "calibration": {k: round(float(v), 6) for k, v in cal.items()} | {"source": source},
            "table": {
                "dense_tokens": dt["dense_tokens"],
                "dense_ms": [round(float(v), 5) for v in table.dense_ms],
                "vidur_dense_ms": [round(float(v), 5) for v in yd],
                "cpu_ms": table.cpu_ms,
                "cpu_ms_per_seq": table.cpu_ms_per_seq,
                "decode_ms_per_seq": table.decode_ms_per_seq,
                "decode_ms_per_ctx_token": table.decode_ms_per_ctx_token,
                "prefill_ms_per_attn_unit": table.prefill_ms_per_attn_unit,
                "prefill_half_eff_tokens": table.prefill_half_eff_tokens,
                "dense_source": f"vidur/{spec.vidur_dir}/mlp.csv.gz, TP{spec.tp}, median, x{spec.layers} layers + emb",
            },
        }
        if spec.calibrate == "vllm-run":
            out[spec.name]["vllm_run"] = {"file": f"vllm-runs/{spec.name}.csv", **VLLM_RUN_SCHED}
    return {"version": 1, "profiles": out}


def dense_from_shared(shared_profiles: Path) -> dict[str, dict[str, Any]]:
    tables = {}
    for spec in SPECS:
        path = shared_profiles / "vidur" / spec.vidur_dir / "mlp.csv.gz"
        n, ms, shape = _vidur_dense(path, spec.layers, spec.tp)
        tables[spec.name] = {"dense_tokens": n, "dense_ms": ms, "shape": shape}
    return tables


def dense_from_vendored(profiles: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tables = {}
    for name, rec in profiles["profiles"].items():
        if "provenance" in rec:  # measured on a real engine (offline.vllm_profile), no Vidur table
            continue
        raw = rec["table"]["vidur_dense_ms"]
        tables[name] = {
            "dense_tokens": rec["table"]["dense_tokens"],
            "dense_ms": raw,
            "shape": rec["shape"],
        }
    return tables


# ---- validate-ttft -------------------------------------------------------------------------


def read_requests(path: Path) -> dict[str, np.ndarray]:
    """A per-request CSV with ``arrival_rel_s, input_tokens, output_tokens, ttft_s`` columns."""
    rows = _read_csv(path)
    need = ("arrival_rel_s", "input_tokens", "output_tokens", "ttft_s")
    if not rows:
        raise ValueError(f"{path}: no rows")
    missing = [c for c in need if c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; need {list(need)}")
    cols = {c: np.array([float(r[c]) for r in rows]) for c in need}
    order = np.argsort(cols["arrival_rel_s"], kind="stable")
    return {c: v[order] for c, v in cols.items()}


def validate_ttft(
    req: dict[str, np.ndarray],
    profile: str,
    sched: Any,
    *,
    oracle: bool = False,
    noise_sigma: float = 0.0,
    seed: int = 0,
    default_output_tokens: int = 256,
) -> dict[str, Any]:
    """Replay arrivals and lengths through the engine; run SFS at each arrival.

    Residents' output lengths for SFS come from a simple causal per-model predictor (mean
    output length of the requests finished so far) unless ``oracle``.
    """
    from loaders.profiles import read_profiles
    from routing.sfs import standalone_ttft_ms
    from routing.throughput_baseline import prefill_tokens_per_s, throughput_ttft_ms
    from sim.engine import SimEngine
    from sim.timing import TableTiming

    profiles = read_profiles()
    model = profiles.model(profile)
    eng = SimEngine(TableTiming.from_profile(profiles, profile, noise_sigma), sched, seed)
    tput = prefill_tokens_per_s(model, sched)
    n = int(req["arrival_rel_s"].size)
    sfs = np.zeros(n)
    thr = np.zeros(n)
    cost_us = np.zeros(n)
    out_sum = 0.0
    out_n = 0
    for i in range(n):
        t = float(req["arrival_rel_s"][i])
        eng.advance_to(t)
        while out_n < len(eng.finished):
            out_sum += eng.finished[out_n].output_tokens
            out_n += 1
        state = eng.snapshot(oracle=oracle)
        delay_ms = (eng.busy_until_s() - t) * 1e3
        p = np.array([int(req["input_tokens"][i])], dtype=np.int64)
        t0 = time.perf_counter()
        sfs[i] = standalone_ttft_ms(state, p, model, sched, start_delay_ms=delay_ms)[0]
        cost_us[i] = (time.perf_counter() - t0) * 1e6
        thr[i] = throughput_ttft_ms(state, p, tput)[0]
        out = max(1, int(req["output_tokens"][i]))
        pred = out if oracle else max(1, round(out_sum / out_n) if out_n else default_output_tokens)
        eng.submit(str(i), t, int(p[0]), out, pred)
    eng.run_until_idle()
    eng_ttft = np.zeros(n)
    for r in eng.finished:
        eng_ttft[int(r.request_id)] = r.ttft_s * 1e3
    real = req["ttft_s"] * 1e3

    def mape(est: np.ndarray) -> float:
        return float(np.mean(np.abs(est - real) / real))

    return {
        "n": n,
        "profile": profile,
        "policy": sched.policy,
        "lengths": "oracle" if oracle else "predicted",
        "mape_engine": round(mape(eng_ttft), 4),
        "mape_sfs": round(mape(sfs), 4),
        "mape_throughput_baseline": round(mape(thr), 4),
        "mape_sfs_vs_engine": round(float(np.mean(np.abs(sfs - eng_ttft) / eng_ttft)), 4),
        "mean_ttft_ms": {
            "real": round(float(real.mean()), 2),
            "engine": round(float(eng_ttft.mean()), 2),
            "sfs": round(float(sfs.mean()), 2),
        },
        "sfs_us_p50": round(float(np.percentile(cost_us, 50)), 1),
        "sfs_us_p99": round(float(np.percentile(cost_us, 99)), 1),
    }


def sched_for(
    profile: str,
    policy: str | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    shared_prefix_tokens: int = 0,
    kv_blocks: int | None = None,
) -> Any:
    """Scheduler settings: flags, else the profile's recorded vLLM run settings, else defaults."""
    from loaders.profiles import profile_record
    from schemas import SchedulerConfig

    rec = profile_record(profile)
    run = rec.get("vllm_run", {})
    kw: dict[str, Any] = {
        "policy": policy or "vllm-v1",
        "kv_blocks": kv_blocks or int(rec.get("kv_blocks", 1_000_000)),
        "shared_prefix_tokens": shared_prefix_tokens,
    }
    mnbt = max_num_batched_tokens or run.get("max_num_batched_tokens")
    if mnbt:
        kw["max_num_batched_tokens"] = int(mnbt)
        kw["chunk_size_tokens"] = min(int(mnbt), 512) if policy == "sarathi" else 512
    mns = max_num_seqs or run.get("max_num_seqs")
    if mns:
        kw["max_num_seqs"] = int(mns)
    return SchedulerConfig(**kw)


# ---- fitting Eq. 9 on the table -----------------------------------------------------------


@dataclass(frozen=True)
class Design:
    """Step compositions to fit on: one row per step."""

    n_tokens: FloatArray
    n_seqs: FloatArray
    n_decode: FloatArray
    decode_ctx: FloatArray
    attn: FloatArray  # sum q(q/2+ctx)
    attn_eff: FloatArray  # the same divided by kernel efficiency


def fit_design(
    budget_tokens: int,
    max_seqs: int,
    half_eff_tokens: float,
    seed: int = 0,
    kv_tokens: int | None = None,
) -> Design:
    """Steps a vLLM instance actually runs: decode-only, prefill-only and mixed batches.

    Decode batches of 1..max_seqs sequences with mean context 64..8192; prefill chunks of
    16..budget tokens on 0..8192 cached tokens; mixed batches of decodes plus one chunk
    (mostly filling the budget: chunked prefill). With ``kv_tokens``, steps whose KV cache
    could not fit on the instance are left out (they would only distort the fit).
    """
    rng = np.random.default_rng(seed)
    rows: list[tuple[float, float, float, float, float, float]] = []

    def add(decodes: int, ctx_mean: float, chunk: int, chunk_ctx: int) -> None:
        if kv_tokens is not None and decodes * ctx_mean + chunk + chunk_ctx > kv_tokens:
            return
        a = float(attn_units(chunk, chunk_ctx)) if chunk else 0.0
        ae = float(attn_eff_units(chunk, chunk_ctx, half_eff_tokens)) if chunk else 0.0
        rows.append(
            (
                float(decodes + chunk),
                float(decodes + (1 if chunk else 0)),
                float(decodes),
                float(decodes * ctx_mean),
                a,
                ae,
            )
        )

    seqs = np.unique(np.geomspace(1, max_seqs, 12).astype(int))
    for n in seqs:
        for ctx in (64, 256, 1024, 2048, 4096, 8192):
            add(int(n), ctx, 0, 0)
    chunks = np.unique(np.geomspace(16, budget_tokens, 14).astype(int))
    for q in chunks:
        for ctx in (0, 512, 2048, 8192):
            add(0, 0, int(q), ctx)
    for _ in range(300):
        n = int(rng.integers(1, max_seqs + 1))
        ctx_mean = float(rng.uniform(128, 4096))
        q = max(0, budget_tokens - n) if rng.random() < 0.7 else int(rng.integers(1, budget_tokens))
        add(n, ctx_mean, min(q, budget_tokens), int(rng.integers(0, 4096)))
    arr = np.asarray(rows, dtype=np.float64)
    return Design(*(arr[:, i].copy() for i in range(6)))


def fit_on_table(table: Table, design: Design) -> FitReport:
    """NNLS fit of Eq. 9 to the table-priced steps of ``design`` (relative error)."""
    t = table.step_ms(
        design.n_tokens, design.n_seqs, design.n_decode, design.decode_ctx, design.attn_eff
    )
    X = features(design.n_tokens, design.decode_ctx, design.attn)
    return fit_nnls(X, t)


def ape(model: StepTimeModel, X: npt.ArrayLike, t_ms: npt.ArrayLike) -> FloatArray:
    """Absolute percentage errors (fractions) of ``model`` on design rows ``X``."""
    A = np.asarray(X, dtype=np.float64)
    y = np.asarray(t_ms, dtype=np.float64)
    return np.asarray(np.abs(A @ model.coef - y) / y, dtype=np.float64)
