"""Fast path for the window ILP: Lagrangian dual of the budget and capacity rows.

Relaxing the budget row with a multiplier μ >= 0 and the capacity rows with prices
v >= 0 leaves one independent choice per query. For any μ >= 0, v >= 0

    D(μ, v) = μ·B + Σ_k cap_k·v_k + Σ_i max(−P, max_k (a_ik − μ·c_ik − v_k))

is an upper bound on the LP relaxation, hence on the ILP optimum (weak duality; the
tenant rows are relaxed with multiplier 0, which keeps the bound valid). Its minimum
over (μ, v) is the LP bound. D is piecewise linear in only k + 1 variables, so we
minimise its entropic smoothing (max → τ·logsumexp(·/τ), which over-estimates D by at
most n·τ·log(k+1)) with L-BFGS-B, lowering τ in a few levels and warm-starting each
level (and, across windows, from the caller's last multipliers). After each level
the primal is rounded from the reduced scores a − μ·c − v: best column per query,
over-full columns keep the queries that lose most by leaving, the budget is restored
by the cheapest utility-per-dollar downgrades, left-over budget buys the best
upgrades, tenant rows are repaired. Every primal is feasible; the gap reported is
certified, (min D − objective) / |objective|, and the loop stops at ``gap_tol`` or at
the deadline (anytime).

``_auction`` (Bertsekas' forward auction for the transportation problem at a fixed
μ, vectorised Jacobi rounds) is kept as an exact-at-ε alternative used by the tests
as a cross-check; it needs ~100-200 rounds at n = 1024, too slow for the hot path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.ilp.problem import DEFERRED, BatchProblem, BoolArray, FloatArray, IntArray, Solution

_UNASSIGNED = -2
_NEG = -np.inf


_SHORT_ROW = 8  # numpy reduces a row shorter than this one element after the other


def _row_max(z: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``z.max(axis=1)`` of an [n, k] array: for a few columns, the maxima of the columns
    taken in turn (the same values; numpy's reduction along a short row costs ~10× more)."""
    k = z.shape[1]
    if k == 0 or k > 2 * _SHORT_ROW:
        out: npt.NDArray[Any] = z.max(axis=1)
        return out
    out = z[:, 0].copy()
    for j in range(1, k):
        np.maximum(out, z[:, j], out=out)
    return out


def _row_sum(z: npt.NDArray[np.floating[Any]]) -> FloatArray:
    """``z.sum(axis=1)`` of an [n, k] float64 array, bit for bit: numpy adds a row shorter
    than ``_SHORT_ROW`` one element after the other, as the columns are added here (tested
    against it), ~5× faster; longer rows are left to numpy."""
    k = z.shape[1]
    if k == 0 or k >= _SHORT_ROW or z.dtype != np.float64:
        out: FloatArray = z.sum(axis=1, dtype=np.float64)
        return out
    out = z[:, 0].astype(np.float64)  # a float64 copy
    for j in range(1, k):
        out += z[:, j]
    return out


def _auction(
    s: FloatArray,
    defer_value: float,
    cap: IntArray,
    price: FloatArray,
    eps_final: float,
    eps_start: float,
    max_rounds: int,
) -> tuple[IntArray, FloatArray, int]:
    """Max-value assignment of rows to columns (cap_k copies each) or to "defer".

    Forward auction with ε-scaling. Returns the assignment (−1 = defer), the column
    prices (the cheapest copy of each column) and the number of bidding rounds.
    """
    n, k = s.shape
    theta = 6.0
    eps = max(eps_start, eps_final)
    q = np.maximum(price, 0.0).astype(np.float64, copy=True)  # price of a free copy
    rounds = 0
    x = np.full(n, _UNASSIGNED, dtype=np.int64)
    hb = np.zeros(n)
    pmin = q.copy()
    final = False
    cleanups = 0
    while True:
        final = eps <= eps_final
        x[:] = _UNASSIGNED
        hb[:] = 0.0
        free = cap.copy()
        pmin = q.copy()
        unassigned = np.arange(n)
        while True:
            while unassigned.size and rounds < max_rounds:
                rounds += 1
                vals = s[unassigned] - pmin
                r = np.arange(unassigned.size)
                j1 = vals.argmax(axis=1)
                b1 = vals[r, j1]
                if k > 1:
                    vals[r, j1] = _NEG
                    b2 = np.maximum(vals.max(axis=1), defer_value)
                else:
                    b2 = np.full(unassigned.size, defer_value)
                to_defer = b1 <= defer_value
                if to_defer.any():
                    x[unassigned[to_defer]] = DEFERRED
                bid_rows = unassigned[~to_defer]
                if bid_rows.size:
                    bid_cols = j1[~to_defer]
                    bids = pmin[bid_cols] + (b1 - b2)[~to_defer] + eps
                    order = np.argsort(bid_cols, kind="stable")
                    bid_rows, bid_cols, bids = bid_rows[order], bid_cols[order], bids[order]
                    cols, starts = np.unique(bid_cols, return_index=True)
                    ends = np.append(starts[1:], bid_cols.size)
                    for j, a0, a1 in zip(
                        cols.tolist(), starts.tolist(), ends.tolist(), strict=True
                    ):
                        rows_j = bid_rows[a0:a1]
                        bids_j = bids[a0:a1]
                        nb = a1 - a0
                        if free[j] >= nb:
                            x[rows_j] = j
                            hb[rows_j] = bids_j
                            free[j] -= nb
                        else:
                            owners = np.flatnonzero(x == j)
                            f = int(free[j])
                            pool_vals = np.concatenate((hb[owners], np.full(f, q[j]), bids_j))
                            pool_ids = np.concatenate(
                                (owners, np.full(f, -1, dtype=np.int64), rows_j)
                            )
                            c_j = int(cap[j])
                            keep = np.zeros(pool_vals.size, dtype=np.bool_)
                            keep[np.argpartition(-pool_vals, c_j - 1)[:c_j]] = True
                            no = owners.size
                            x[owners[~keep[:no]]] = _UNASSIGNED
                            won = keep[no + f :]
                            x[rows_j[won]] = j
                            hb[rows_j[won]] = bids_j[won]
                            free[j] = int((pool_ids[keep] == -1).sum())
                        if free[j] > 0:
                            pmin[j] = q[j]
                        else:
                            pmin[j] = float(hb[x == j].min())
                unassigned = np.flatnonzero(x == _UNASSIGNED)
            if not final or rounds >= max_rounds or cleanups >= 3:
                break
            # Columns left with free copies must end at price 0 (complementary slackness
            # of a slack capacity row); lower them and let unhappy rows bid again.
            stale = (free > 0) & (pmin > 0)
            if not stale.any():
                break
            cleanups += 1
            q[stale] = 0.0
            pmin[stale] = 0.0
            # every copy of a slack column is priced 0, owned ones included, so owners stay happy
            hb[np.isin(x, np.flatnonzero(stale))] = 0.0
            routed = x >= 0
            own = np.where(routed, s[np.arange(n), np.maximum(x, 0)] - hb, defer_value)
            best = np.maximum((s - pmin).max(axis=1), defer_value)
            unhappy = own < best - eps
            if not unhappy.any():
                break
            free += np.bincount(x[unhappy & routed], minlength=k).astype(np.int64)
            x[unhappy] = _UNASSIGNED
            for j in np.flatnonzero(free > 0):
                pmin[j] = q[j]
            unassigned = np.flatnonzero(unhappy)
        if final or rounds >= max_rounds:
            break
        eps = max(eps / theta, eps_final)
        q = pmin.copy()
    if (x == _UNASSIGNED).any():  # round limit: place the rest greedily within capacity
        counts = np.bincount(x[x >= 0], minlength=k)
        for i in np.flatnonzero(x == _UNASSIGNED).tolist():
            row = np.where(counts < cap, s[i], _NEG)
            j = int(row.argmax())
            if row[j] > defer_value:
                x[i] = j
                counts[j] += 1
            else:
                x[i] = DEFERRED
    return x, pmin, rounds


def dual_bound(p: BatchProblem, mu: float, v: FloatArray) -> float:
    """D(μ, v): a valid upper bound on the window optimum for any μ >= 0, v >= 0."""
    v = np.maximum(v, 0.0)
    s = np.where(p.mask, p.a - mu * p.c, _NEG) - v
    per_row = np.maximum(_row_max(s) if p.k else np.full(p.n, _NEG), -p.penalty)
    budget_term = mu * p.budget_usd if mu > 0 else 0.0
    return float(budget_term + float(p.cap @ v) + per_row.sum())


def greedy_feasible(p: BatchProblem) -> IntArray:
    """A quick feasible assignment that routes as many queries as it can.

    Every query to its cheapest column with room (most constrained queries first),
    the budget restored by deferring the most expensive, tenant rows repaired, then
    left-over budget spent on the best utility-per-dollar upgrades.
    """
    x = np.full(p.n, DEFERRED, dtype=np.int64)
    counts = np.zeros(p.k, dtype=np.int64)
    cost = np.where(p.mask, p.c, np.inf)
    order = np.lexsort((cost.min(axis=1), p.mask.sum(axis=1)))
    for i in order.tolist():
        row = np.where(counts < p.cap, cost[i], np.inf)
        j = int(row.argmin())
        if np.isfinite(row[j]):
            x[i] = j
            counts[j] += 1
    x = repair_groups(p, _cut_spend(p, x))
    return repair_groups(p, _upgrade(p, x))


def repair_groups(p: BatchProblem, x: IntArray) -> IntArray:
    """Make tenant rows hold: cheapen, then defer, rows of over-spending groups."""
    if not p.has_groups:
        return x
    assert p.group is not None and p.group_budget_usd is not None
    x = x.copy()
    gs = p.group_spend(x)
    over = np.flatnonzero(gs > p.group_budget_usd)
    if not over.size:
        return x
    counts = np.bincount(x[x >= 0], minlength=p.k)
    for g in over.tolist():
        excess = gs[g] - p.group_budget_usd[g]
        rows = np.flatnonzero((p.group == g) & (x >= 0))
        # cheaper alternatives: smallest utility loss per dollar saved first
        moves: list[tuple[float, int, int, float]] = []
        for i in rows.tolist():
            ci = p.c[i, x[i]]
            alt = p.mask[i] & (p.c[i] < ci)
            for j in np.flatnonzero(alt).tolist():
                saved = ci - p.c[i, j]
                moves.append(((p.a[i, x[i]] - p.a[i, j]) / saved, i, j, saved))
        moves.sort()
        moved: set[int] = set()
        for _, i, j, saved in moves:
            if excess <= 0:
                break
            if i in moved or counts[j] >= p.cap[j]:
                continue
            counts[x[i]] -= 1
            counts[j] += 1
            x[i] = j
            moved.add(i)
            excess -= saved
        if excess > 0:
            rows = np.flatnonzero((p.group == g) & (x >= 0))
            for i in rows[np.argsort(-p.c[rows, x[rows]])].tolist():
                if excess <= 0:
                    break
                excess -= p.c[i, x[i]]
                counts[x[i]] -= 1
                x[i] = DEFERRED
    return x


def _reduced(p: BatchProblem, mu: float, v: FloatArray) -> FloatArray:
    """[n, k+1] reduced scores; the last column is "defer" (−P)."""
    r = np.empty((p.n, p.k + 1))
    r[:, : p.k] = np.where(p.mask, p.a - mu * p.c - v, _NEG)
    r[:, p.k] = -p.penalty
    return r


def round_primal(p: BatchProblem, mu: float, v: FloatArray) -> IntArray:
    """Capacity-feasible assignment from reduced scores (budget not yet enforced).

    Best column per query; an over-full column keeps the queries that lose most by
    leaving and closes; the evicted move to their best open column; at most k rounds.
    """
    k = p.k
    r = _reduced(p, mu, v)
    x: IntArray = r.argmax(axis=1).astype(np.int64)
    x[x == k] = DEFERRED
    counts = np.bincount(x[x >= 0], minlength=k)
    closed = np.zeros(k + 1, dtype=np.bool_)
    for _ in range(k + 1):
        over = np.flatnonzero(counts > p.cap)
        if not over.size:
            break
        shut = closed.copy()  # the columns closed before this pass
        evicted: list[IntArray] = []
        for j in over.tolist():
            rows = np.flatnonzero(x == j)
            alt = np.where(shut, _NEG, r[rows])  # only the over-full column's rows
            alt[:, j] = _NEG
            margin = r[rows, j] - _row_max(alt)
            evicted.append(rows[np.argsort(-margin, kind="stable")[int(p.cap[j]) :]])
            counts[j] = p.cap[j]
            closed[j] = True
        ev = np.concatenate(evicted)
        closed[:k] |= counts >= p.cap
        choice = np.where(closed, _NEG, r[ev]).argmax(axis=1)
        x[ev] = np.where(choice == k, DEFERRED, choice)
        counts = np.bincount(x[x >= 0], minlength=k)
    return x


def _cut_spend(p: BatchProblem, x: IntArray) -> IntArray:
    """Restore the window budget with the cheapest utility-per-dollar downgrades."""
    x = x.copy()
    counts = np.bincount(x[x >= 0], minlength=p.k)
    for _ in range(8):
        excess = p.spend(x) - p.budget_usd
        if excess <= 0:
            return x
        rows = np.flatnonzero(x >= 0)
        cur_a = p.a[rows, x[rows]]
        cur_c = p.c[rows, x[rows]]
        saved = cur_c[:, None] - p.c[rows]
        loss = cur_a[:, None] - p.a[rows]
        ok = p.mask[rows] & (saved > 0) & (counts < p.cap)[None, :]
        ratio = np.where(ok, loss / np.where(saved > 0, saved, 1.0), np.inf)
        jb = ratio.argmin(axis=1)
        rb = ratio[np.arange(rows.size), jb]
        moved = False
        for t in np.argsort(rb, kind="stable").tolist():
            if excess <= 0 or not np.isfinite(rb[t]):
                break
            i, j = int(rows[t]), int(jb[t])
            if counts[j] >= p.cap[j]:
                continue
            counts[x[i]] -= 1
            counts[j] += 1
            excess -= float(saved[t, j])
            x[i] = j
            moved = True
        if not moved:
            break
    # still over: defer the most expensive queries
    excess = p.spend(x) - p.budget_usd
    if excess > 0:
        rows = np.flatnonzero(x >= 0)
        for i in rows[np.argsort(-p.c[rows, x[rows]], kind="stable")].tolist():
            if excess <= 0:
                break
            excess -= float(p.c[i, x[i]])
            x[i] = DEFERRED
    return x


def _upgrade(p: BatchProblem, x: IntArray) -> IntArray:
    """Spend left-over budget and free capacity on the best utility-per-dollar moves."""
    x = x.copy()
    left = p.budget_usd - p.spend(x)
    counts = np.bincount(x[x >= 0], minlength=p.k)
    cur_a = np.where(x >= 0, p.a[np.arange(p.n), np.maximum(x, 0)], -p.penalty)
    cur_c = np.where(x >= 0, p.c[np.arange(p.n), np.maximum(x, 0)], 0.0)
    gain = p.a - cur_a[:, None]
    extra = p.c - cur_c[:, None]
    ok = p.mask & (gain > 1e-12) & (counts < p.cap)[None, :] & (extra <= left)
    if not ok.any():
        return x
    ratio = np.where(ok, gain / np.maximum(extra, 1e-300), -np.inf)
    ratio = np.where(ok & (extra <= 0), np.inf, ratio)
    score = np.where(ok, ratio, -np.inf)
    jb = score.argmax(axis=1)
    cand = np.flatnonzero(ok[np.arange(p.n), jb])
    order = cand[np.lexsort((-gain[cand, jb[cand]], -score[cand, jb[cand]]))]
    for i in order.tolist():
        j = int(jb[i])
        d = float(extra[i, j])
        if d <= left + 1e-15 and counts[j] < p.cap[j]:
            if x[i] >= 0:
                counts[x[i]] -= 1
            x[i] = j
            counts[j] += 1
            left -= d
    return x


@dataclass
class _Smoothed:
    """Entropic smoothing of D in normalised units (costs divided by ``cost_scale``)."""

    a: FloatArray
    c: FloatArray
    cap: FloatArray
    budget: float
    penalty: float
    tau: float = 1.0
    evals: int = 0
    _a32: npt.NDArray[np.float32] | None = None
    _c32: npt.NDArray[np.float32] | None = None
    _c_finite: bool | None = None

    def __call__(self, z: FloatArray) -> tuple[float, FloatArray]:
        self.evals += 1
        mu, v = float(z[0]), z[1:]
        t = self.tau
        # float32 halves the cost of the exponentials on big windows; the certified
        # bound is recomputed in float64 by ``dual_bound`` at the point this returns
        big = self.a.size >= 16_384
        if big:
            zz: npt.NDArray[np.floating[Any]] = (
                self.a32 - np.float32(mu) * self.c32 - v.astype(np.float32)
            )
            zz *= np.float32(1.0 / t)
        elif mu == 0.0 and self.c_finite:
            # a − 0·c is a itself when every cost is finite: the same values, two passes fewer
            zz = self.a - v
            zz *= 1.0 / t
        else:
            zz = (self.a - mu * self.c - v) * (1.0 / t)
        d = -self.penalty / t
        m = np.maximum(_row_max(zz).astype(np.float64, copy=False), d)
        zz -= m.astype(zz.dtype, copy=False)[:, None]
        np.exp(zz, out=zz)
        ed = np.exp(d - m)
        den = _row_sum(zz) + ed
        value = mu * self.budget + float(self.cap @ v) + t * float((m + np.log(den)).sum())
        zz *= (1.0 / den).astype(zz.dtype, copy=False)[:, None]
        g = np.empty_like(z)
        g[0] = self.budget - float((zz * (self.c32 if big else self.c)).sum(dtype=np.float64))
        g[1:] = self.cap - zz.sum(axis=0, dtype=np.float64)
        return value, g

    @property
    def c_finite(self) -> bool:
        if self._c_finite is None:
            self._c_finite = bool(np.isfinite(self.c).all())
        return self._c_finite

    @property
    def a32(self) -> npt.NDArray[np.float32]:
        if self._a32 is None:
            self._a32 = self.a.astype(np.float32)
        return self._a32

    @property
    def c32(self) -> npt.NDArray[np.float32]:
        if self._c32 is None:
            self._c32 = self.c.astype(np.float32)
        return self._c32


def _lbfgs_nonneg(
    f: _Smoothed,
    z0: FloatArray,
    fixed: BoolArray,
    upper: FloatArray,
    step0: float,
    max_iter: int,
    rel_tol: float,
    history: int = 8,
) -> FloatArray:
    """Projected L-BFGS for min f(z) s.t. 0 <= z <= upper (``fixed`` entries stay 0).

    Written out in numpy on purpose: the problem has only k + 1 variables, and
    scipy's L-BFGS-B spends milliseconds per iteration in BLAS thread hand-offs on a
    busy machine, which a router cannot afford.
    """
    z = np.where(fixed, 0.0, np.clip(z0, 0.0, upper))
    val, g = f(z)
    g = np.where(fixed, 0.0, g)
    ss: list[FloatArray] = []
    ys: list[FloatArray] = []
    for _ in range(max_iter):
        active = ((z <= 0.0) & (g > 0.0)) | ((z >= upper) & (g < 0.0))
        pg = np.where(active, 0.0, g)
        gmax = float(np.abs(pg).max())
        if gmax <= 1e-9:
            break
        # two-loop recursion on the free variables
        q = pg.copy()
        alphas: list[float] = []
        for s_, y_ in zip(reversed(ss), reversed(ys), strict=True):
            rho = 1.0 / float(y_ @ s_)
            al = rho * float(s_ @ q)
            alphas.append(al)
            q -= al * y_
        if ys:
            gamma = float(ss[-1] @ ys[-1]) / float(ys[-1] @ ys[-1])
        else:
            gamma = step0 / gmax
        q *= gamma
        for (s_, y_), al in zip(zip(ss, ys, strict=True), reversed(alphas), strict=True):
            rho = 1.0 / float(y_ @ s_)
            b = rho * float(y_ @ q)
            q += (al - b) * s_
        d = np.where(active, 0.0, -q)
        if float(d @ pg) >= 0.0:  # not a descent direction: restart
            ss.clear()
            ys.clear()
            d = -pg * (step0 / gmax)
        t = 1.0
        while True:
            zn = np.where(fixed, 0.0, np.clip(z + t * d, 0.0, upper))
            vn, gn = f(zn)
            if vn <= val + 1e-4 * float(g @ (zn - z)) or t < 1e-8:
                break
            t *= 0.25
        gn = np.where(fixed, 0.0, gn)
        s_new, y_new = zn - z, gn - g
        if float(s_new @ y_new) > 1e-12 * float(s_new @ s_new) ** 0.5:
            ss.append(s_new)
            ys.append(y_new)
            if len(ss) > history:
                ss.pop(0)
                ys.pop(0)
        converged = abs(val - vn) <= rel_tol * max(1.0, abs(val))
        z, val, g = zn, vn, gn
        if converged:
            break
    return z


@dataclass
class WarmStart:
    """Multipliers of the previous window (μ in utility per USD, v per column)."""

    mu: float = 0.0
    v: FloatArray | None = None


def solve_fast(
    p: BatchProblem,
    gap_tol: float = 1e-3,
    deadline: float | None = None,
    warm: WarmStart | None = None,
    taus: tuple[float, ...] = (0.005, 0.001, 0.0002, 0.00005, 0.0000125),
    max_iter: int = 40,
) -> Solution:
    """Feasible assignment with a certified gap; stops at ``gap_tol`` or ``deadline``.

    ``deadline`` is a ``time.perf_counter()`` value; past it the best feasible
    assignment found so far is returned with ``deadline_hit``. ``taus`` are the
    smoothing temperatures relative to the spread of the utilities.
    """
    n, k = p.n, p.k
    if n == 0 or k == 0 or not p.mask.any():
        x = np.full(n, DEFERRED, dtype=np.int64)
        obj = p.objective(x)
        return Solution(x, obj, obj, 0.0, 0.0, "fast")
    if n == 1:  # one query (per-arrival routing): the best affordable column, exactly
        limit = p.budget_usd
        if (
            p.has_groups
            and p.group is not None
            and p.group_budget_usd is not None
            and p.group[0] >= 0
        ):
            limit = min(limit, float(p.group_budget_usd[p.group[0]]))
        ok = p.mask[0] & (p.c[0] <= limit)
        x = np.full(1, DEFERRED, dtype=np.int64)
        if ok.any():
            x[0] = int(np.where(ok, p.a[0], _NEG).argmax())
        obj = p.objective(x)
        return Solution(x, obj, obj, 0.0, p.spend(x), "fast")
    a_feas = p.a[p.mask]
    spread = max(float(a_feas.max() - a_feas.min()), 1e-6 * max(1.0, float(np.abs(a_feas).max())))
    c_feas = p.c[p.mask]
    cost_scale = float(c_feas.mean()) if c_feas.size and c_feas.mean() > 0 else 1.0
    budget_bounded = bool(np.isfinite(p.budget_usd))
    f = _Smoothed(
        a=np.where(p.mask, p.a, _NEG),
        c=p.c / cost_scale,
        cap=p.cap.astype(np.float64),
        budget=p.budget_usd / cost_scale if budget_bounded else 0.0,
        penalty=p.penalty,
    )
    z = np.zeros(k + 1)
    if warm is not None and np.isfinite(warm.mu):
        z[0] = max(warm.mu, 0.0) * cost_scale
        if warm.v is not None and len(warm.v) == k:
            z[1:] = np.maximum(warm.v, 0.0)
    if not budget_bounded:
        z[0] = 0.0
    fixed = np.zeros(k + 1, dtype=np.bool_)
    fixed[0] = not budget_bounded
    # beyond these multipliers every routed pair scores below "defer": D is flat there
    top = float(np.abs(a_feas).max()) + p.penalty + spread
    c_pos = f.c[p.mask & (p.c > 0)]
    upper = np.full(k + 1, top)
    upper[0] = top / float(c_pos.min()) if c_pos.size else 0.0

    best_x = np.full(n, DEFERRED, dtype=np.int64)  # always feasible
    best_obj = p.objective(best_x)
    best_ub = np.inf
    best_mu = 0.0
    best_v = np.zeros(k)
    deadline_hit = False
    levels = 0

    def consider(x: IntArray) -> None:
        nonlocal best_x, best_obj
        obj = p.objective(x)
        if obj > best_obj and not p.violations(x):
            best_x, best_obj = x, obj

    # μ = 0, v = 0 first: when the best columns fit, this is optimal at once
    x0 = round_primal(p, 0.0, np.zeros(k))
    best_ub = dual_bound(p, 0.0, np.zeros(k))
    if p.spend(x0) <= p.budget_usd:
        consider(repair_groups(p, _upgrade(p, x0)))
    small = n * k < 2048
    mu, v = 0.0, np.zeros(k)
    if small:
        # small window: its integrality gap (one query's worth) dwarfs 0.1%, which no
        # Lagrangian bound certifies; spend fewer iterations chasing the bound
        taus, max_iter = taus[::2], min(max_iter, 25)
    for tau_rel in taus:
        if best_ub - best_obj <= gap_tol * max(abs(best_obj), 1e-9):
            break
        if deadline is not None and time.perf_counter() >= deadline:
            deadline_hit = True
            break
        levels += 1
        f.tau = tau_rel * spread
        z = _lbfgs_nonneg(
            f, z, fixed, upper, step0=spread, max_iter=max_iter, rel_tol=0.01 * gap_tol
        )
        mu, v = float(z[0]) / cost_scale, z[1:].copy()
        ub = dual_bound(p, mu, v)
        prev_gap = best_ub - best_obj
        if ub < best_ub:
            best_ub, best_mu, best_v = ub, mu, v
        # rounding is cheap next to a level: also round at nearby budget multipliers,
        # which moves the few near-tied queries to the other side of the budget row
        for scale in (1.0, 0.99, 1.01, 0.97) if mu > 0 else (1.0,):
            x = _cut_spend(p, round_primal(p, mu * scale, v))
            consider(repair_groups(p, _upgrade(p, x)))
            if best_ub - best_obj <= gap_tol * max(abs(best_obj), 1e-9):
                break
        if small and levels >= 2 and best_ub - best_obj > 0.8 * prev_gap:
            # diminishing returns: what is left is the integrality gap of a small
            # window (one query's worth), which no Lagrangian bound can close
            break
    open_gap = best_ub - best_obj > gap_tol * max(abs(best_obj), 1e-9)
    if open_gap and not small and not deadline_hit and levels:
        # last resort before giving up on the tolerance: round at more multipliers
        for scale in (0.995, 1.005, 0.985, 1.015, 0.95, 1.05):
            x = _cut_spend(p, round_primal(p, mu * scale, v))
            consider(repair_groups(p, _upgrade(p, x)))
            if best_ub - best_obj <= gap_tol * max(abs(best_obj), 1e-9):
                break
    if deadline_hit or best_ub - best_obj > gap_tol * max(abs(best_obj), 1e-9):
        consider(greedy_feasible(p))
    best_ub = max(best_ub, best_obj)
    return Solution(
        assignment=best_x,
        objective=best_obj,
        bound=best_ub,
        budget_dual=best_mu,
        spend_usd=p.spend(best_x),
        solver="fast",
        iterations=f.evals,
        deadline_hit=deadline_hit,
        capacity_dual=best_v,
    )
