"""Offline instance allocation (paper B, "Offline instance allocation").

Before serving, choose how many instances I_j of each local model to run under a GPU
budget, to maximise the expected batch quality of routing on historical data:

    maximise   1/(S·w) Σ_s Σ_{i in window s} Σ_j a_ij x_sij
    subject to Σ_j x_sij <= 1                       every query of every window
               Σ_{i in s} x_sij <= l_j · I_j         every window s, local model j
               Σ_{i in s} Σ_j c_ij x_sij <= C         every window s (optional budget)
               Σ_j g_j · I_j <= G                    the GPU budget
               I_j ∈ {0, 1, 2, ...},  x ∈ [0, 1]

over S windows of w queries sampled from the data (or given as rows): one mixed-integer
program whose integer instance counts are shared by all windows. A query not served
scores 0. Cloud models (g_j = 0) have no instance limit. x is continuous: for fixed counts
the window problem is a transportation problem with one budget row, whose LP optimum is
integral but for at most a couple of queries per window, so this is the batch ILP's value
up to that rounding.

``serve_first`` is paper B's reading, where every query is assigned: the program
maximises the queries served first and quality second, by valuing each pair at
a_ij − min a + K with K = 1 + the widest score spread of a window, so one more query
served outweighs any quality difference inside a window. The quality reported is
still the unshifted mean score.

Solved by HiGHS (scipy.optimize.milp). Pure: arrays in, arrays out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import LinearConstraint, milp

from routing.types import FloatArray, IntArray


@dataclass(frozen=True)
class AllocationProblem:
    scores: FloatArray  # [n, m] historical quality per (query, model)
    cost_usd: FloatArray  # [n, m]
    gpus_per_instance: IntArray  # [m], 0: cloud endpoint (no instance limit)
    slots_per_instance: IntArray  # [m] queries one instance takes per window (l_j)
    gpu_budget: int
    window_size: int = 64
    n_windows: int = 16
    window_budget_usd: float | None = None
    seed: int = 0
    # [S, w] query rows of the windows; None: n_windows windows of window_size rows drawn
    # with ``seed``
    window_rows: IntArray | None = None
    serve_first: bool = False  # maximise queries served, then quality (see the module doc)

    def __post_init__(self) -> None:
        a = np.asarray(self.scores, dtype=np.float64)
        c = np.asarray(self.cost_usd, dtype=np.float64)
        if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
            raise ValueError(
                f"scores must be a non-empty [queries, models] array, got shape {a.shape}"
            )
        n, m = a.shape
        if not np.isfinite(a).all():
            i, j = (int(v) for v in np.argwhere(~np.isfinite(a))[0])
            raise ValueError(f"scores[{i}, {j}] is {a[i, j]}: scores must be finite")
        if c.shape != (n, m):
            raise ValueError(f"cost_usd has shape {c.shape}, expected {(n, m)}")
        if not (np.isfinite(c) & (c >= 0)).all():
            i, j = (int(v) for v in np.argwhere(~(np.isfinite(c) & (c >= 0)))[0])
            raise ValueError(f"cost_usd[{i}, {j}] is {c[i, j]}: costs must be finite and >= 0")
        for name in ("gpus_per_instance", "slots_per_instance"):
            v = np.asarray(getattr(self, name))
            if v.shape != (m,):
                raise ValueError(f"{name} has shape {v.shape}, expected ({m},)")
            if (v < 0).any() or not np.isfinite(v.astype(np.float64)).all():
                raise ValueError(f"{name} must be >= 0, got {v.tolist()}")
        if (np.asarray(self.slots_per_instance)[np.asarray(self.gpus_per_instance) > 0] < 1).any():
            raise ValueError("slots_per_instance must be >= 1 for models that need GPUs")
        if self.gpu_budget < 0:
            raise ValueError(f"gpu_budget must be >= 0, got {self.gpu_budget}")
        if self.window_size < 1 or self.n_windows < 1:
            raise ValueError("window_size and n_windows must be >= 1")
        if self.window_budget_usd is not None and (
            math.isnan(self.window_budget_usd) or self.window_budget_usd < 0
        ):
            raise ValueError(f"window_budget_usd must be >= 0, got {self.window_budget_usd}")
        if self.window_rows is not None:
            rows = np.asarray(self.window_rows)
            if rows.ndim != 2 or rows.size == 0 or rows.dtype.kind not in "iu":
                raise ValueError(
                    "window_rows must be a non-empty [windows, queries] integer array, "
                    f"got shape {rows.shape} of {rows.dtype}"
                )
            if rows.min() < 0 or rows.max() >= n:
                raise ValueError(
                    f"window_rows must index the {n} queries, got rows "
                    f"{int(rows.min())}..{int(rows.max())}"
                )

    @property
    def m(self) -> int:
        return int(np.asarray(self.scores).shape[1])

    def windows(self) -> IntArray:
        """[S, w] query rows of the windows: ``window_rows``, or sampled (without replacement
        inside a window)."""
        if self.window_rows is not None:
            return np.asarray(self.window_rows, dtype=np.int64)
        n = int(np.asarray(self.scores).shape[0])
        rng = np.random.default_rng(self.seed)
        w = min(self.window_size, n)
        out: IntArray = np.stack(
            [rng.choice(n, size=w, replace=False) for _ in range(self.n_windows)]
        ).astype(np.int64)
        return out


@dataclass(frozen=True)
class Allocation:
    instances: IntArray  # [m]; cloud models report 0
    gpus_used: int
    expected_quality: float  # mean score per sampled query, unserved queries count 0
    bound: float  # nan with serve_first: the solver's bound is on the shifted objective
    solver_seconds: float
    status: str

    @property
    def gap(self) -> float:
        if math.isnan(self.bound):
            return math.nan
        return max(0.0, self.bound - self.expected_quality) / max(abs(self.expected_quality), 1e-12)


def _values(p: AllocationProblem, win: IntArray) -> tuple[FloatArray, FloatArray]:
    """(what the program maximises, the quality it reports): [S, w, m] each, per query of
    a window and per model."""
    a = np.asarray(p.scores, dtype=np.float64)[win]
    if not p.serve_first:
        return a, a
    spread = 1.0 + float((a.max(axis=(1, 2)) - a.min(axis=(1, 2))).max())
    return a - float(a.min()) + spread, a


def _model(
    p: AllocationProblem, fixed: IntArray | None
) -> tuple[FloatArray, sp.csr_matrix, FloatArray, FloatArray, FloatArray, FloatArray, int]:
    a = np.asarray(p.scores, dtype=np.float64)
    c = np.asarray(p.cost_usd, dtype=np.float64)
    g = np.asarray(p.gpus_per_instance, dtype=np.int64)
    slots = np.asarray(p.slots_per_instance, dtype=np.int64)
    win = p.windows()
    S, w = win.shape
    m = a.shape[1]
    nx = S * w * m
    local = np.flatnonzero(g > 0)
    nI = local.size
    rows_q = np.repeat(np.arange(S * w), m)  # one row per (window, query)
    cols_x = np.arange(nx)
    blocks: list[sp.csr_matrix] = [
        sp.csr_matrix((np.ones(nx), (rows_q, cols_x)), shape=(S * w, nx + nI))
    ]
    ub: list[FloatArray] = [np.ones(S * w)]
    lb: list[FloatArray] = [np.full(S * w, -np.inf)]
    if nI:
        # Σ_i x_sij − l_j I_j <= 0 for every window s and local model j
        s_idx = np.repeat(np.arange(S), w * m)
        j_idx = np.tile(np.arange(m), S * w)
        pos = {int(j): t for t, j in enumerate(local.tolist())}
        is_local = np.isin(j_idx, local)
        row = s_idx[is_local] * nI + np.array(
            [pos[int(j)] for j in j_idx[is_local]], dtype=np.int64
        )
        A = sp.csr_matrix(
            (np.ones(int(is_local.sum())), (row, cols_x[is_local])), shape=(S * nI, nx + nI)
        )
        B = sp.csr_matrix(
            (
                np.tile(-slots[local].astype(np.float64), S),
                (np.arange(S * nI), nx + np.tile(np.arange(nI), S)),
            ),
            shape=(S * nI, nx + nI),
        )
        blocks.append((A + B).tocsr())
        ub.append(np.zeros(S * nI))
        lb.append(np.full(S * nI, -np.inf))
        blocks.append(
            sp.csr_matrix(
                (g[local].astype(np.float64), (np.zeros(nI), nx + np.arange(nI))),
                shape=(1, nx + nI),
            )
        )
        ub.append(np.array([float(p.gpu_budget)]))
        lb.append(np.array([-np.inf]))
    if p.window_budget_usd is not None:
        cw = c[win].reshape(S, w * m)
        rows_b = np.repeat(np.arange(S), w * m)
        blocks.append(sp.csr_matrix((cw.ravel(), (rows_b, cols_x)), shape=(S, nx + nI)))
        ub.append(np.full(S, float(p.window_budget_usd)))
        lb.append(np.full(S, -np.inf))
    A_all = sp.vstack(blocks, format="csr")
    value, _ = _values(p, win)
    obj = np.concatenate([-value.ravel() / (S * w), np.zeros(nI)])
    lo = np.zeros(nx + nI)
    hi = np.concatenate([np.ones(nx), np.full(nI, np.inf)])
    if fixed is not None:
        lo[nx:] = fixed[local]
        hi[nx:] = fixed[local]
    return obj, A_all, np.concatenate(lb), np.concatenate(ub), lo, hi, nx


def evaluate_allocation(p: AllocationProblem, instances: IntArray) -> float:
    """Expected batch quality of a given allocation on the sampled windows (LP)."""
    fixed = np.asarray(instances, dtype=np.int64)
    if fixed.shape != (p.m,) or (fixed < 0).any():
        raise ValueError(f"instances must be {p.m} counts >= 0, got {fixed.tolist()}")
    obj, A, lb, ub, lo, hi, nx = _model(p, fixed)
    res = milp(
        obj, constraints=LinearConstraint(A, lb, ub), bounds=(lo, hi), options={"disp": False}
    )
    if res.x is None:
        raise RuntimeError(f"evaluating the allocation failed: {res.message}")
    if not p.serve_first:
        return -float(res.fun)
    win = p.windows()
    _, quality = _values(p, win)
    return float(quality.ravel() @ res.x[:nx]) / win.size


def solve_allocation(
    p: AllocationProblem, time_limit_s: float | None = None, mip_rel_gap: float = 1e-4
) -> Allocation:
    """Instance counts maximising expected batch quality under the GPU budget."""
    obj, A, lb, ub, lo, hi, nx = _model(p, None)
    g = np.asarray(p.gpus_per_instance, dtype=np.int64)
    local = np.flatnonzero(g > 0)
    integrality = np.concatenate([np.zeros(nx), np.ones(local.size)])
    opts: dict[str, float | bool] = {"disp": False, "mip_rel_gap": mip_rel_gap}
    if time_limit_s is not None:
        opts["time_limit"] = time_limit_s
    t0 = time.perf_counter()
    res = milp(
        obj,
        constraints=LinearConstraint(A, lb, ub),
        integrality=integrality,
        bounds=(lo, hi),
        options=opts,
    )
    seconds = time.perf_counter() - t0
    if res.x is None:
        raise RuntimeError(f"allocation MIP found no solution: {res.message}")
    counts = np.zeros(p.m, dtype=np.int64)
    counts[local] = np.rint(res.x[nx:]).astype(np.int64)
    quality = evaluate_allocation(p, counts)  # re-evaluate at the rounded counts
    bound_raw = getattr(res, "mip_dual_bound", None)
    bound = -float(bound_raw) if bound_raw is not None else quality
    if p.serve_first:
        bound = math.nan
    return Allocation(
        instances=counts,
        gpus_used=int((counts * g).sum()),
        expected_quality=quality,
        bound=bound if math.isnan(bound) else max(bound, quality),
        solver_seconds=seconds,
        status=str(res.message),
    )


def uniform_allocation(p: AllocationProblem) -> IntArray:
    """The fixed baseline: instances dealt out evenly, one per local model in turn
    (best mean score first), while the GPU budget lasts."""
    g = np.asarray(p.gpus_per_instance, dtype=np.int64)
    local = np.flatnonzero(g > 0)
    counts = np.zeros(p.m, dtype=np.int64)
    if not local.size:
        return counts
    order = local[np.argsort(-np.asarray(p.scores).mean(axis=0)[local], kind="stable")]
    left = int(p.gpu_budget)
    while True:
        placed = False
        for j in order.tolist():
            if g[j] <= left:
                counts[j] += 1
                left -= int(g[j])
                placed = True
        if not placed:
            return counts
