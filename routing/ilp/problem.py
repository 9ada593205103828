"""The window problem of paper B (robust batch ILP) on plain arrays, and its solution.

    maximise   Σ_i Σ_k a_ik x_ik  −  P · Σ_i d_i
    subject to Σ_k x_ik + d_i = 1                 every query i (d_i = 1: deferred)
               Σ_i Σ_k c_ik x_ik ≤ B              window budget
               Σ_{i in g} Σ_k c_ik x_ik ≤ B_g     each budget group g (tenant)
               Σ_i x_ik ≤ cap_k                   every column k (instance free slots,
                                                  or l_j·I_j when columns are models)
               x_ik = 0 where the pair is infeasible (SLO, unknown model, cuts)
               x, d ∈ {0, 1}

Paper B writes Σ_k x_ik = 1 as an equality; a stream cannot make an unaffordable
window feasible, so each query may be deferred at a penalty P. By default
P = 1 + n·(max a − min a), which makes the objective lexicographic: first route as
many queries as budget and capacity allow, then maximise utility among those.
Utilities may already include −λ·cost (paper A's trade-off); that is the caller's
choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

DEFERRED = -1


def _first_bad(mask: BoolArray) -> tuple[int, ...]:
    idx = np.argwhere(mask)[0]
    return tuple(int(v) for v in idx)


@dataclass(frozen=True)
class BatchProblem:
    """One window: n queries × k columns. Values at infeasible pairs are ignored."""

    utility: FloatArray  # a[n, k]: robust lower bound or point estimate (− λ·cost)
    cost_usd: FloatArray  # c[n, k] >= 0
    capacity: IntArray  # cap[k] >= 0
    budget_usd: float = float("inf")
    feasible: BoolArray | None = None  # [n, k]; None: every pair
    group: IntArray | None = None  # [n] budget group per query, -1 for none
    group_budget_usd: FloatArray | None = None  # [g]
    defer_penalty: float | None = None  # None: lexicographic default (see module doc)
    # derived, filled in __post_init__
    a: FloatArray = field(init=False, repr=False)
    c: FloatArray = field(init=False, repr=False)
    mask: BoolArray = field(init=False, repr=False)
    cap: IntArray = field(init=False, repr=False)
    penalty: float = field(init=False)

    def __post_init__(self) -> None:
        a = np.asarray(self.utility, dtype=np.float64)
        c = np.asarray(self.cost_usd, dtype=np.float64)
        if a.ndim != 2:
            raise ValueError(f"utility must be a 2-D array [queries, columns], got shape {a.shape}")
        n, k = a.shape
        if c.shape != (n, k):
            raise ValueError(f"cost_usd has shape {c.shape}, expected {(n, k)} like utility")
        if self.feasible is None:
            mask = np.ones((n, k), dtype=np.bool_)
        else:
            mask = np.asarray(self.feasible, dtype=np.bool_)
            if mask.shape != (n, k):
                raise ValueError(f"feasible has shape {mask.shape}, expected {(n, k)}")
        cap_raw = np.asarray(self.capacity, dtype=np.float64)
        if cap_raw.shape != (k,):
            raise ValueError(f"capacity has shape {cap_raw.shape}, expected ({k},)")
        if np.isnan(cap_raw).any() or (cap_raw < 0).any():
            j = int(np.flatnonzero(np.isnan(cap_raw) | (cap_raw < 0))[0])
            raise ValueError(f"capacity[{j}] must be >= 0 (free slots), got {cap_raw[j]}")
        cap = np.minimum(cap_raw, float(n)).astype(np.int64)  # inf: unlimited
        if mask.any():
            bad = mask & ~np.isfinite(a)
            if bad.any():
                i, j = _first_bad(bad)
                raise ValueError(
                    f"utility[{i}, {j}] is {a[i, j]}: utilities of feasible pairs must be finite"
                )
            bad = mask & ~(np.isfinite(c) & (c >= 0))
            if bad.any():
                i, j = _first_bad(bad)
                raise ValueError(
                    f"cost_usd[{i}, {j}] is {c[i, j]}: costs of feasible pairs must be finite and >= 0"
                )
        b = float(self.budget_usd)
        if np.isnan(b) or b < 0:
            raise ValueError(f"budget_usd must be >= 0 (inf for none), got {b}")
        if (self.group is None) != (self.group_budget_usd is None):
            raise ValueError("group and group_budget_usd must be given together")
        if self.group is not None and self.group_budget_usd is not None:
            g = np.asarray(self.group, dtype=np.int64)
            gb = np.asarray(self.group_budget_usd, dtype=np.float64)
            if g.shape != (n,):
                raise ValueError(f"group has shape {g.shape}, expected ({n},)")
            if gb.ndim != 1:
                raise ValueError("group_budget_usd must be 1-D")
            if n and (g.min() < -1 or g.max() >= len(gb)):
                raise ValueError(f"group ids must be in [-1, {len(gb) - 1}]")
            if np.isnan(gb).any() or (gb < 0).any():
                j = int(np.flatnonzero(np.isnan(gb) | (gb < 0))[0])
                raise ValueError(f"group_budget_usd[{j}] must be >= 0, got {gb[j]}")
            object.__setattr__(self, "group", g)
            object.__setattr__(self, "group_budget_usd", gb)
        mask = mask & (cap > 0)[None, :]
        a = np.where(mask, a, 0.0)
        c = np.where(mask, c, 0.0)
        if self.defer_penalty is None:
            spread = float(a[mask].max() - a[mask].min()) if mask.any() else 0.0
            penalty = 1.0 + n * spread + (float(np.abs(a[mask]).max()) if mask.any() else 0.0)
        else:
            penalty = float(self.defer_penalty)
            if not np.isfinite(penalty) or penalty < 0:
                raise ValueError(f"defer_penalty must be finite and >= 0, got {penalty}")
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "c", c)
        object.__setattr__(self, "mask", mask)
        object.__setattr__(self, "cap", cap)
        object.__setattr__(self, "penalty", penalty)

    @property
    def n(self) -> int:
        return int(self.a.shape[0])

    @property
    def k(self) -> int:
        return int(self.a.shape[1])

    @property
    def has_groups(self) -> bool:
        return (
            self.group is not None
            and self.group_budget_usd is not None
            and len(self.group_budget_usd) > 0
        )

    def with_changes(
        self, *, feasible: BoolArray | None = None, capacity: IntArray | None = None
    ) -> BatchProblem:
        """Same problem with a tighter mask or capacities (TTFT cuts)."""
        return BatchProblem(
            utility=self.a,
            cost_usd=self.c,
            capacity=self.cap if capacity is None else capacity,
            budget_usd=self.budget_usd,
            feasible=self.mask if feasible is None else feasible,
            group=self.group,
            group_budget_usd=self.group_budget_usd,
            defer_penalty=self.penalty,
        )

    # -- evaluation of an assignment ------------------------------------------------

    def objective(self, x: IntArray) -> float:
        """Penalised objective Σ a − P·deferred of an assignment (−1 = deferred)."""
        routed = x >= 0
        rows = np.flatnonzero(routed)
        return float(self.a[rows, x[rows]].sum()) - self.penalty * float((~routed).sum())

    def utility_of(self, x: IntArray) -> float:
        rows = np.flatnonzero(x >= 0)
        return float(self.a[rows, x[rows]].sum())

    def spend(self, x: IntArray) -> float:
        rows = np.flatnonzero(x >= 0)
        return float(self.c[rows, x[rows]].sum())

    def group_spend(self, x: IntArray) -> FloatArray:
        assert self.group is not None and self.group_budget_usd is not None
        rows = np.flatnonzero((x >= 0) & (self.group >= 0))
        # bincount adds the weights in row order, as np.add.at does (the same sums), ~10× faster
        out: FloatArray = np.asarray(
            np.bincount(
                self.group[rows],
                weights=self.c[rows, x[rows]],
                minlength=len(self.group_budget_usd),
            ),
            dtype=np.float64,
        )
        return out

    def violations(self, x: IntArray, tol: float = 1e-9) -> list[str]:
        """Every broken constraint of ``x``, in words (empty: feasible)."""
        out: list[str] = []
        if x.shape != (self.n,):
            return [f"assignment has shape {x.shape}, expected ({self.n},)"]
        if ((x < -1) | (x >= self.k)).any():
            out.append("assignment has column ids out of range")
            return out
        rows = np.flatnonzero(x >= 0)
        if (~self.mask[rows, x[rows]]).any():
            i = int(rows[np.flatnonzero(~self.mask[rows, x[rows]])[0]])
            out.append(f"query {i} assigned to infeasible column {int(x[i])}")
        counts = np.bincount(x[rows], minlength=self.k)
        over = np.flatnonzero(counts > self.cap)
        for j in over:
            out.append(f"column {int(j)} has {int(counts[j])} queries, capacity {int(self.cap[j])}")
        spend = self.spend(x)
        if spend > self.budget_usd * (1 + tol) + tol:
            out.append(f"spend {spend} exceeds budget {self.budget_usd}")
        if self.has_groups:
            assert self.group_budget_usd is not None
            gs = self.group_spend(x)
            for g in np.flatnonzero(gs > self.group_budget_usd * (1 + tol) + tol):
                out.append(f"group {int(g)} spends {gs[g]}, budget {self.group_budget_usd[g]}")
        return out


@dataclass(frozen=True)
class Solution:
    """A feasible assignment and what is known about its optimality."""

    assignment: IntArray  # [n] column per query, -1 = deferred
    objective: float  # penalised objective of ``assignment``
    bound: float  # proven upper bound on the optimum (LP / Lagrangian / branch-and-bound)
    budget_dual: float  # multiplier of the window budget row (utility per USD; paper A's λ)
    spend_usd: float
    solver: str
    iterations: int = 0
    deadline_hit: bool = False
    status: str = "ok"
    # the capacity rows' multipliers (utility per slot, one per column) at ``bound`` when the
    # solver has them (the fast path), else None: a warm start for a re-solve with cuts
    capacity_dual: FloatArray | None = None

    @property
    def gap(self) -> float:
        """Certified relative gap (bound − objective) / max(|objective|, 1e-9), >= 0."""
        return relative_gap(self.objective, self.bound)

    @property
    def n_deferred(self) -> int:
        return int((self.assignment < 0).sum())


def relative_gap(objective: float, bound: float) -> float:
    diff = bound - objective
    if diff <= 1e-9 * max(1.0, abs(objective)):
        return 0.0
    return diff / max(abs(objective), 1e-9)
