"""SFS: Serving-Framework-Simulation TTFT estimator (paper A, "SFS estimator", steps 1-5).

Given an instance's live state R_j(t) (resident requests with their progress and predicted
output lengths) and new queries appended FCFS, simulate the instance's scheduling policy
(``routing.scheduling``) deterministically and price every simulated batch with Eq. 9
(``routing.steptime``)::

    TTFT_i = start_delay + sum over simulated steps until query i's first token of
             c0 + c1*N_tokens + c2*sum ctx_decode + c3*sum q*(q/2 + ctx)

The simulation jumps from one change of batch composition to the next (``Segment``) and sums
Eq. 9 over each segment in closed form, so its cost grows with the number of requests that
start or finish ahead of the new queries, not with the number of steps or tokens.

:func:`standalone_ttft_ms` answers "TTFT of each candidate if it alone were appended" for
many candidates at once: under vLLM V1 and Sarathi-Serve a request appended last never
changes what the residents are scheduled (it only takes the budget they leave), and its own
Eq. 9 cost telescopes: ``sum q*(q/2+ctx) = (P^2 - K^2)/2`` however the prompt is chunked.
So one residents-only simulation serves every candidate and each candidate costs a few
vector operations. (It assumes the candidate triggers no preemption; :func:`estimate_ttft_ms`
is the exact reference.)

Long context: a candidate whose prompt the instance's KV cache can never hold (prompt +
one output token > ``kv_blocks`` x ``block_size_tokens``) gets :data:`UNSERVABLE_MS`, a
finite "never", from both functions and takes no part in the simulation (the engine would
refuse it). A candidate that fits alone but not beside the residents waits, or is preempted
and re-admitted, exactly as the scheduling model says; every answer is finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from routing.length import conditional_output_tokens
from routing.scheduling import Workload, kv_capacity_tokens
from routing.steptime import StepTimeModel
from routing.types import InstanceState, RecentFinished
from schemas import SchedulerConfig

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

DEFAULT_OUTPUT_TOKENS = 128

UNSERVABLE_MS = 1e9  # finite "never": a prompt this instance's KV cache can never hold


def servable(prompt_tokens: IntArray, sched: SchedulerConfig) -> npt.NDArray[np.bool_]:
    """Prompts the KV cache can hold with at least their first output token."""
    out: npt.NDArray[np.bool_] = np.maximum(prompt_tokens, 1) + 1 <= kv_capacity_tokens(sched)
    return out


def _check_state(state: InstanceState) -> None:
    bad = np.flatnonzero(
        (state.decoded_tokens > 0) & (state.prefilled_tokens < state.prompt_tokens)
    )
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"InstanceState row {i}: decoded_tokens ({int(state.decoded_tokens[i])}) must be 0 "
            f"until the prompt is fully prefilled ({int(state.prefilled_tokens[i])} of "
            f"{int(state.prompt_tokens[i])} tokens)"
        )
    bad = np.flatnonzero(state.predicted_output_tokens < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"InstanceState row {i}: predicted_output_tokens must be >= 1, "
            f"got {int(state.predicted_output_tokens[i])}"
        )


def _as_tokens(name: str, values: IntArray | list[int], min_value: int) -> IntArray:
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        if values.size == 0 or int(values.min()) >= min_value:
            return values
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of token counts, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold whole token counts, got {arr[:5].tolist()}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < min_value)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] must be >= {min_value}, got {int(arr[i])}")
    return arr


def workload_from_state(state: InstanceState, sched: SchedulerConfig) -> Workload:
    """The scheduler's view of a snapshot (validated; errors name the bad row).

    A resident longer than this configuration's KV cache can hold (a snapshot from an
    engine configured otherwise) is taken as cut to fit, so that SFS still answers.
    """
    _check_state(state)
    cap = kv_capacity_tokens(sched)
    return Workload(
        np.minimum(state.prompt_tokens, cap - 1),
        state.prefilled_tokens,
        state.decoded_tokens,
        state.predicted_output_tokens,
        sched,
    )


def _default_output(state: InstanceState, k: int) -> IntArray:
    if state.n:
        mean = float(np.mean(state.predicted_output_tokens))
        return np.full(k, max(1, round(mean)), dtype=np.int64)
    return np.full(k, DEFAULT_OUTPUT_TOKENS, dtype=np.int64)


def _hits(name: str, hit_tokens: IntArray | None, k: int) -> IntArray:
    if hit_tokens is None:
        return np.zeros(k, dtype=np.int64)
    h = _as_tokens(name, hit_tokens, 0)
    if h.size != k:
        raise ValueError(f"{name} has {h.size} rows, prompt_tokens has {k}")
    return h


def estimate_ttft_ms(
    state: InstanceState,
    prompt_tokens: IntArray,
    model: StepTimeModel,
    sched: SchedulerConfig,
    output_tokens: IntArray | None = None,
    *,
    start_delay_ms: float = 0.0,
    hit_tokens: IntArray | None = None,
    shared_tokens: IntArray | None = None,
    block_tokens: FloatArray | None = None,
    over_ms: FloatArray | None = None,
    added_ms: float = 0.0,
) -> FloatArray:
    """TTFT (ms from now) of each new query if all are appended FCFS, in this order.

    ``output_tokens`` are the new queries' (predicted) output lengths; they matter for the
    queries behind them. Default: the residents' mean prediction, else 128.
    ``start_delay_ms``: time until the instance's in-flight step ends (the snapshot is the
    state after it). Prefix cache (``routing.prefix``): ``hit_tokens[i]`` of query i's
    prompt are cached here already; ``shared_tokens[i, j]`` (j < i) of them it shares with
    the earlier query j. A prompt is cached as it is prefilled (whole blocks of
    ``block_tokens[j]``, default 1), so query i, when admitted, also skips what of its
    shared prefixes the earlier queries have computed by then: the first query warms the
    cache for the next.

    ``over_ms`` (optional, one bound per new query; ``inf``: no bound): for a caller that
    only needs the first query, in order, whose TTFT + ``added_ms`` exceeds its bound. The
    simulation stops as soon as that query is certain: every query before it is known to
    meet its bound (or has none) and it is known to break it, or is still waiting at a time
    already past it (its TTFT can only be later). That query's TTFT is then the time
    reached (a lower bound, already over), the queries not reached are NaN, and every TTFT
    returned is the one the full simulation gives. Without a query over its bound the
    result is the full one.
    """
    prompts = _as_tokens("prompt_tokens", prompt_tokens, 0)
    k = int(prompts.size)
    if k == 0:
        return np.zeros(0)
    outs = (
        _default_output(state, k)
        if output_tokens is None
        else _as_tokens("output_tokens", output_tokens, 1)
    )
    if outs.size != k:
        raise ValueError(f"output_tokens has {outs.size} rows, prompt_tokens has {k}")
    hits = _hits("hit_tokens", hit_tokens, k)
    ok = servable(prompts, sched)
    ttft = np.where(ok, np.nan, UNSERVABLE_MS)
    new_rows = np.flatnonzero(ok)  # candidate of each appended row
    w = workload_from_state(state, sched)
    n0 = w.n
    w.append(prompts[ok], outs[ok], hits[ok])
    ids = np.arange(n0 + new_rows.size)
    warm = _Warming.of(n0, ok, hits, shared_tokens, block_tokens)
    t = float(start_delay_ms)
    bound = None if over_ms is None else np.asarray(over_ms, dtype=np.float64)
    if bound is not None and bound.shape != (k,):
        raise ValueError(f"over_ms has shape {bound.shape}, prompt_tokens has {k} rows")
    while np.isnan(ttft).any():
        if bound is not None and _first_over_certain(ttft, bound, t, added_ms):
            break
        if warm is not None:
            warm.update(w, ids)
        seg = w.plan()
        if seg is None:  # pragma: no cover - a servable waiting row is always schedulable
            raise RuntimeError("SFS: nothing schedulable while new queries are still waiting")
        t += seg.total_ms(model)
        done = w.apply(seg)
        if done.first_token.size:
            got = ids[done.first_token]
            got = new_rows[got[got >= n0] - n0]
            # a candidate preempted after its first token gets a "first token" again when
            # it is re-admitted: only the first one counts
            got = got[np.isnan(ttft[got])]
            ttft[got] = t
        if done.finished.size:
            if warm is not None:
                warm.finished(ids[done.finished])
            w.remove(done.finished)
            ids = np.delete(ids, done.finished)
    return ttft


def _first_over_certain(ttft: FloatArray, bound: FloatArray, t: float, added_ms: float) -> bool:
    """Whether the first query in order over its bound is certain at simulated time ``t``
    (``estimate_ttft_ms``'s ``over_ms``); if it is still waiting, its TTFT is set to ``t``."""
    # a query with no bound, or known to meet it, cannot be the first over
    open_ = ~((ttft + added_ms <= bound) | (bound == np.inf))
    if not open_.any():
        return False
    r = int(np.argmax(open_))
    if not np.isnan(ttft[r]):
        return True  # known, and over its bound
    if t + added_ms > bound[r]:  # still waiting: its first token comes at t or later
        ttft[r] = t
        return True
    return False


@dataclass
class _Warming:
    """New queries that share prefixes with earlier new queries (``estimate_ttft_ms``),
    restricted to the servable ones: row ``a`` of ``shared`` is the a-th appended row."""

    row_id: IntArray  # workload row id of each appended candidate (ids stay sorted)
    shared: IntArray  # [m, m] tokens of a's prompt that b (< a) shares
    block: FloatArray  # [m] cache granularity of each candidate's prompt (tokens per block)
    base: IntArray  # [m] each one's own cache hit
    progress: FloatArray  # [m] most of each prompt seen computed so far

    @classmethod
    def of(
        cls,
        n0: int,
        ok: npt.NDArray[np.bool_],
        hits: IntArray,
        shared: IntArray | None,
        block: FloatArray | None,
    ) -> _Warming | None:
        if shared is None:
            return None
        k = int(ok.size)
        sh = np.asarray(shared, dtype=np.int64)
        if sh.shape != (k, k):
            raise ValueError(f"shared_tokens must have shape {(k, k)}, got {sh.shape}")
        sh = np.tril(np.maximum(sh, 0), -1)[np.ix_(ok, ok)]
        if not sh.any():
            return None
        bt = np.ones(k) if block is None else np.maximum(np.asarray(block, np.float64), 1.0)
        m = int(ok.sum())
        return cls(n0 + np.arange(m), sh, bt[ok], hits[ok], np.zeros(m))

    def update(self, w: Workload, ids: IntArray) -> None:
        """Waiting candidates get what of their shared prefixes is computed by now."""
        pos = np.searchsorted(ids, self.row_id)
        here = (pos < ids.size) & (ids[np.minimum(pos, ids.size - 1)] == self.row_id)
        pos = np.minimum(pos, ids.size - 1)
        done = np.where(here, np.minimum(w.prefilled[pos], w.prompt[pos]), 0)
        self.progress = np.maximum(self.progress, done)
        cached = np.floor(self.progress / self.block + 1e-9) * self.block  # whole blocks [m]
        warm = np.minimum(self.shared, cached[None, :]).max(axis=1)
        hit = np.maximum(self.base, warm.astype(np.int64))
        waiting = here & (w.prefilled[pos] == 0)
        w.hit[pos[waiting]] = hit[waiting]

    def finished(self, row_ids: IntArray) -> None:
        """A candidate that finished had computed its whole prompt."""
        self.progress = np.where(np.isin(self.row_id, row_ids), np.inf, self.progress)


@dataclass(frozen=True)
class LaterArrivals:
    """Requests expected to reach the instance after the candidate: ``rate_per_ms`` of
    them, ``prompt_tokens`` each on average (:func:`later_arrivals`).

    vLLM schedules running requests first and then admits waiting ones with the token
    budget left, so a request arriving after the candidate never delays it by taking its
    tokens, but it does join the candidate's last prefill step with the budget that step
    leaves, and makes it longer (Eq. 9: ``c1`` per token and its attention). SFS prices
    the expected share: with N ~ Poisson(rate x time until that step starts) arrivals of
    ``prompt_tokens`` each, ``E[min(left budget, N x prompt_tokens)]`` more tokens."""

    rate_per_ms: float
    prompt_tokens: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_ms) and self.rate_per_ms >= 0):
            raise ValueError(f"LaterArrivals.rate_per_ms must be >= 0, got {self.rate_per_ms}")
        if not (math.isfinite(self.prompt_tokens) and self.prompt_tokens >= 0):
            raise ValueError(
                f"LaterArrivals.prompt_tokens must be >= 0, got {self.prompt_tokens}"
            )


LATER_WINDOW_MS = 1000.0  # arrivals counted for the rate: those of the last second


def later_arrivals(
    state: InstanceState,
    waited_ms: FloatArray,
    finished: RecentFinished | None = None,
    window_ms: float = LATER_WINDOW_MS,
) -> LaterArrivals:
    """The recent arrival rate and mean prompt at an instance, from its snapshot: the
    residents (``waited_ms`` ago) and the recently finished requests that arrived within
    ``window_ms``. A bounded finished list that holds nothing older than the window
    counts over the span it covers."""
    waited = np.asarray(waited_ms, dtype=np.float64)
    prompts = [state.prompt_tokens[(waited > 0.0) & (waited <= window_ms)]]
    span = float(window_ms)
    if finished is not None and finished.n:
        recent = finished.arrived_ms <= window_ms
        prompts.append(finished.prompt_tokens[recent])
    p = np.concatenate(prompts) if prompts else np.zeros(0, dtype=np.int64)
    if p.size == 0 or span <= 0.0:
        return LaterArrivals(0.0, 0.0)
    return LaterArrivals(p.size / span, float(p.mean()))


def _later_ms(
    ttft_ms: FloatArray,
    left_tokens: FloatArray,
    last_step_ms: FloatArray,
    seats: FloatArray,
    later: LaterArrivals,
    model: StepTimeModel,
) -> FloatArray:
    """Expected extra time of each candidate's last prefill step from later arrivals (at
    most ``seats`` of them: the step's ``max_num_seqs`` left)."""
    L = np.where(seats >= 1.0, np.maximum(left_tokens, 0.0), 0.0)
    pbar = max(later.prompt_tokens, 1.0)
    mu = later.rate_per_ms * np.maximum(ttft_ms - last_step_ms, 0.0)
    if later.rate_per_ms <= 0.0 or not L.any():
        return np.zeros_like(ttft_ms)
    # beyond min(seats, L / prompt) arrivals nothing more fits: the tail term covers them
    kmax = int(min(math.ceil(float(L.max()) / pbar), max(float(seats.max()), 0.0)))
    k = np.arange(kmax + 1, dtype=np.float64)
    # Poisson probabilities P(N = k) for k = 0..kmax, one row per candidate
    ratio = np.where(k[None, 1:] > 0, mu[:, None] / np.maximum(k[None, 1:], 1.0), 0.0)
    pk = np.exp(-mu)[:, None] * np.concatenate(
        [np.ones((mu.size, 1)), np.cumprod(ratio, axis=1)], axis=1
    )
    admitted = np.minimum(k[None, :], np.maximum(seats, 0.0)[:, None])
    tokens = np.minimum(admitted * pbar, L[:, None])  # min(L, N x prompt)
    tail = np.minimum(np.maximum(seats, 0.0) * pbar, L)  # N > kmax: as many as fit
    expect = (pk * tokens).sum(axis=1) + tail * np.maximum(1.0 - pk.sum(axis=1), 0.0)
    out: FloatArray = (
        model.c1_ms_per_token * expect + model.c3_ms_per_attn_unit * expect * expect / 2.0
    )
    return out


def standalone_ttft_ms(
    state: InstanceState,
    prompt_tokens: IntArray,
    model: StepTimeModel,
    sched: SchedulerConfig,
    *,
    start_delay_ms: float = 0.0,
    hit_tokens: IntArray | None = None,
    later: LaterArrivals | None = None,
) -> FloatArray:
    """TTFT (ms from now) of each candidate if it alone were appended to ``state``.

    Vectorised over candidates: one residents-only simulation, then a few array operations
    per candidate. Equals ``estimate_ttft_ms(state, [p], ...)`` for each ``p`` unless the
    candidate's own KV usage would trigger a preemption. ``hit_tokens[i]``: prompt tokens
    of candidate i already in this instance's prefix cache (it prefills only the rest).
    ``later``: requests expected after the candidate, priced in its last prefill step
    (:class:`LaterArrivals`); None: nobody comes after it.
    """
    prompts = _as_tokens("prompt_tokens", prompt_tokens, 0)
    if prompts.size == 0:
        return np.zeros(0)
    hits = _hits("hit_tokens", hit_tokens, int(prompts.size))
    if sched.policy == "vllm-v0":
        # prefill-first: a new prompt delays the residents, so no shared timeline exists
        return np.array(
            [
                estimate_ttft_ms(
                    state,
                    np.array([p]),
                    model,
                    sched,
                    start_delay_ms=start_delay_ms,
                    hit_tokens=np.array([h]),
                )[0]
                for p, h in zip(prompts.tolist(), hits.tolist(), strict=True)
            ]
        )
    ok = servable(prompts, sched)
    if not ok.all():
        out = np.full(prompts.size, UNSERVABLE_MS)
        if ok.any():
            out[ok] = standalone_ttft_ms(
                state, prompts[ok], model, sched, start_delay_ms=start_delay_ms,
                hit_tokens=hits[ok], later=later,
            )  # fmt: skip
        return out
    P = np.maximum(prompts, 1)
    hit = np.minimum(np.maximum(hits, sched.shared_prefix_tokens), P - 1)
    need = P - hit
    budget = sched.chunk_size_tokens if sched.policy == "sarathi" else sched.max_num_batched_tokens
    bs = sched.block_size_tokens
    first_blocks = -(-(hit + np.minimum(need, budget)) // bs)
    # a prompt completes its prefill only where the cache has room for all of it: admitted
    # earlier, vLLM preempts it (the latest request) when its later chunks find no blocks
    room_blocks = -(-(P + 1) // bs)
    own_ms = (
        model.c1_ms_per_token * need
        + model.c3_ms_per_attn_unit
        * (P.astype(np.float64) ** 2 - np.asarray(hit, dtype=np.float64) ** 2)
        / 2.0
    )

    fast = (
        None
        if later is not None
        else _all_decoding_fast_path(state, need, first_blocks, model, sched, budget)
    )
    if fast is not None:
        return np.asarray(float(start_delay_ms) + fast + own_ms, dtype=np.float64)

    w = workload_from_state(state, sched)
    starts: list[float] = []
    steps: list[float] = []
    base: list[float] = []
    growth: list[float] = []
    left: list[float] = []
    free: list[float] = []  # KV blocks free for a new request; -1: cannot admit at all
    seats: list[float] = []  # sequences a step may still admit beside the candidate
    t = float(start_delay_ms)
    need_max = int(need.max())
    min_blocks = int(room_blocks.min())
    started = False
    got = 0
    while True:
        seg = w.plan()
        if seg is None:
            break
        b = budget - seg.n_tokens
        can = (
            b > 0
            and seg.n_running < sched.max_num_seqs
            and seg.n_waiting == 0
            and not seg.preempted
        )
        f = float(sched.kv_blocks - seg.kv_blocks_used) if can else -1.0
        bg = seg.base_growth_ms(model)
        starts.append(t)
        steps.append(float(seg.steps))
        base.append(bg[0])
        growth.append(bg[1])
        left.append(float(b))
        free.append(f)
        seats.append(float(sched.max_num_seqs - seg.n_running - 1))
        if started or f >= min_blocks:
            started = True
            got += seg.steps * b
            if got >= need_max:
                break
        t += seg.total_ms(model)
        done = w.apply(seg)
        if done.finished.size:
            w.remove(done.finished)
    else:  # pragma: no cover
        pass
    if not (started and got >= need_max):
        # residents run out: idle steps that cost c0 each and leave the whole budget
        starts.append(t)
        steps.append(np.inf)
        base.append(model.c0_ms)
        growth.append(0.0)
        left.append(float(budget))
        free.append(float(sched.kv_blocks))
        seats.append(float(sched.max_num_seqs - 1))
    T = np.asarray(starts)
    kk = np.asarray(steps)
    bb = np.asarray(left)
    a = np.asarray(base)
    g = np.asarray(growth)
    fr = np.asarray(free)
    C = np.concatenate([[0.0], np.cumsum(kk * bb)])
    # first segment where each candidate can be admitted
    ok = fr[None, :] >= room_blocks[:, None]
    # Candidates that find no room in the scanned residents-only timeline (the scan stopped
    # once the smallest could start and all had their tokens): simulate each exactly.
    stuck = np.flatnonzero(~ok.any(axis=1))
    i0 = ok.argmax(axis=1)
    target = C[i0] + need
    i_end = np.searchsorted(C, target, side="left") - 1
    i_end = np.clip(i_end, i0, len(T) - 1)
    m = np.ceil((target - C[i_end]) / bb[i_end])
    resident_ms = T[i_end] + m * a[i_end] + g[i_end] * m * (m - 1) / 2.0
    own_ms = (
        model.c1_ms_per_token * need
        + model.c3_ms_per_attn_unit
        * (P.astype(np.float64) ** 2 - np.asarray(hit, dtype=np.float64) ** 2)
        / 2.0
    )
    out = np.asarray(resident_ms + own_ms, dtype=np.float64)
    if later is not None:
        q_last = target - C[i_end] - (m - 1.0) * bb[i_end]  # the candidate's last chunk
        step_ms = a[i_end] + g[i_end] * (m - 1.0) + model.c1_ms_per_token * q_last
        seats_left = np.asarray(seats)[i_end]
        out = out + _later_ms(out, bb[i_end] - q_last, step_ms, seats_left, later, model)
    for i in stuck:
        out[i] = _exact(state, int(P[i]), int(hit[i]), model, sched, start_delay_ms)
    return out


def _exact(
    state: InstanceState,
    prompt: int,
    hit: int,
    model: StepTimeModel,
    sched: SchedulerConfig,
    start_delay_ms: float,
) -> float:
    """One (servable) candidate through the full FCFS simulation."""
    got = estimate_ttft_ms(
        state,
        np.array([prompt], dtype=np.int64),
        model,
        sched,
        start_delay_ms=start_delay_ms,
        hit_tokens=np.array([hit], dtype=np.int64),
    )
    return float(got[0])


def _all_decoding_fast_path(
    state: InstanceState,
    need: IntArray,
    first_blocks: IntArray,
    model: StepTimeModel,
    sched: SchedulerConfig,
    budget: int,
) -> FloatArray | None:
    """Residents' share of each candidate's TTFT when every resident is decoding and the
    candidates finish their prefill before the first resident finishes: then the batch is
    the same decodes every step, with ``budget - n`` tokens left for the candidate, and
    ``sum of m steps = m*base + growth*m*(m-1)/2`` (Eq. 9, contexts growing by one per step).
    None when the general path is needed.
    """
    p = state.prompt_tokens
    n = p.size
    if n == 0 or n >= sched.max_num_seqs or budget <= n:
        return None
    if not (state.prefilled_tokens == p).all():
        return None
    dec = state.decoded_tokens
    out = state.predicted_output_tokens
    if int(out.min()) < 1 or int(dec.min()) < 1:
        return None
    k1 = max(int((out - dec).min()), 1)
    left = budget - n
    m = -(-need // left)
    mm = int(m.max())
    if mm > k1:
        return None
    ctx_sum = int(p.sum()) + int(dec.sum()) - n  # each decode attends to prompt + output - 1
    bs = sched.block_size_tokens
    # KV: an upper bound on the blocks held after mm steps, plus the candidate's own
    bound = (ctx_sum + n * mm) // bs + n + int(need.max()) // bs + 1
    if bound > sched.kv_blocks:
        ctx = p + dec - 1
        used = int(((ctx + bs) // bs).sum())
        if int(first_blocks.max()) > sched.kv_blocks - used:
            return None
        grown = int(((ctx + mm + bs - 1) // bs).sum())
        if grown + -(-int(need.max()) // bs) > sched.kv_blocks:
            return None
    base = model.c0_ms + model.c1_ms_per_token * n + model.c2_ms_per_ctx_token * ctx_sum
    growth = model.c2_ms_per_ctx_token * n
    mf = m.astype(np.float64)
    return np.asarray(mf * base + growth * mf * (mf - 1.0) / 2.0, dtype=np.float64)


def _finished_in_replay(finished: RecentFinished | None, start_ms: float) -> tuple[IntArray, float]:
    """Rows of ``finished`` the replay from ``start_ms`` (ms relative to now, <= 0) must
    include: those that left after the replay starts. One that arrived before that start
    moves the start back to its arrival, which may take in more: repeated until nothing
    changes (at most once per row). Returns the rows and the replay's start."""
    if finished is None or finished.n == 0:
        return np.zeros(0, dtype=np.int64), start_ms
    left_at = -finished.finished_ms
    arrived_at = -finished.arrived_ms
    while True:
        sel = np.flatnonzero(left_at > start_ms)
        new_start = min(start_ms, float(arrived_at[sel].min())) if sel.size else start_ms
        if new_start >= start_ms:
            return sel, start_ms
        start_ms = new_start


def catch_up(
    state: InstanceState,
    waited_ms: FloatArray,
    model: StepTimeModel,
    sched: SchedulerConfig,
    finished: RecentFinished | None = None,
) -> tuple[InstanceState, float]:
    """What the engine did since each resident reached it: the state SFS should start from,
    and the time until the engine's step in flight ends (SFS's ``start_delay_ms``).

    For an engine whose stream says nothing before a request's first token (a real vLLM),
    a snapshot lists every request still without one as not prefilled at all, though the
    engine has been prefilling it since it arrived; and a new request joins only at the
    next step boundary (vLLM schedules between steps), so it first waits for the step in
    flight. ``waited_ms[i]``: how long resident ``i`` has been at the engine.
    ``finished``: requests that left the instance recently (``RecentFinished``: arrival,
    prompt, output and departure); those that left after the replay starts took the
    engine's steps in it, and the replay runs them too.

    * No resident waiting for its first token: the step in flight is the residents' next
      decode step at an unknown phase, so half of it remains on average.
    * Otherwise the scheduler (``routing.scheduling``, FCFS with chunked prefill) replays
      the past: from the oldest resident's arrival (earlier where a finished request that
      left after it had arrived earlier) every step is priced with Eq. 9 and each resident
      and each such finished request joins, as a fresh prompt, at the first step boundary
      after its arrival (the decoding residents too: their prefill took the engine's steps
      then). Residents never finish in the replay; a finished request leaves once it has
      produced its output tokens. Rows of unknown age (``waited_ms`` 0) that decode, and
      rows with reported prefill progress, are taken as they are now from the start (after
      half the step then in flight).
    * The step running at the present moment is the step in flight: the state after it is
      returned with the time until it ends. A waiting resident the replay completes before
      then is counted prefilled by the end of the step in flight (its first token is on its
      way). Requests that left before the replay starts, or that the snapshot no longer
      lists (``finished`` is bounded), are not replayed.

    Cost: one scheduler replay over the residents and the selected finished requests (a
    segment per arrival, admission and departure), so it grows with how many the caller
    passes, not with the number of steps.
    """
    n = state.n
    waited = np.asarray(waited_ms, dtype=np.float64)
    if waited.shape != (n,):
        raise ValueError(f"waited_ms has shape {waited.shape}, the state has {n} rows")
    if n == 0:
        return state, 0.0
    if not np.all(np.isfinite(waited)):
        raise ValueError("waited_ms must be finite")
    waited = np.maximum(waited, 0.0)
    _check_state(state)
    waiting = (state.decoded_tokens == 0) & (state.prefilled_tokens == 0)
    never = np.full(n, np.iinfo(np.int32).max, dtype=np.int64)  # no resident finishes in the replay
    if not waiting.any():
        w = workload_from_state(
            InstanceState(state.prompt_tokens, state.prefilled_tokens, state.decoded_tokens, never),
            sched,
        )
        seg = w.plan()
        return state, (0.5 * seg.base_growth_ms(model)[0] if seg is not None else 0.0)
    # rows replayed from their arrival: the waiting ones, and the decoding ones of known age
    # (their prefill also took the engine's steps since the oldest waiting one arrived); the
    # rest (reported progress, unknown age) are taken as they are from the start
    decoding = (state.decoded_tokens > 0) & (state.prefilled_tokens >= state.prompt_tokens)
    fresh = waiting | (decoding & (waited > 0.0))
    others = np.flatnonzero(~fresh)
    w = workload_from_state(
        InstanceState(
            state.prompt_tokens[others],
            state.prefilled_tokens[others],
            state.decoded_tokens[others],
            never[others],
        ),
        sched,
    )
    cap = kv_capacity_tokens(sched)
    res_rows = np.flatnonzero(fresh)
    fin_rows, _ = _finished_in_replay(finished, float(-waited[res_rows].max()))
    # arrivals in FCFS order (ms relative to now): residents are state rows (>= 0), finished
    # requests -1 - their row in ``finished``; at equal times a finished request came first
    fin = finished if finished is not None else RecentFinished.of(np.zeros((0, 4)))
    arrive = np.concatenate([-waited[res_rows], -fin.arrived_ms[fin_rows]])
    label = np.concatenate([res_rows, -1 - fin_rows])
    prompts = np.concatenate([state.prompt_tokens[res_rows], fin.prompt_tokens[fin_rows]])
    outs = np.concatenate([never[res_rows], fin.output_tokens[fin_rows]])
    order = np.lexsort((label, arrive))
    arrive, label = arrive[order], label[order]
    prompts = np.minimum(prompts[order].astype(np.int64), cap - 1)
    outs = np.maximum(outs[order].astype(np.int64), 1)
    rows = [int(i) for i in others]  # workload row -> state row (finished: negative)
    t = float(arrive.min())  # the replay's start
    if others.size:
        seg = w.plan()
        if seg is not None:
            t += 0.5 * seg.base_growth_ms(model)[0]
    k = 0
    end = 0.0
    while True:
        while k < arrive.size and arrive[k] <= t + 1e-9:
            w.append(prompts[k : k + 1], outs[k : k + 1])
            rows.append(int(label[k]))
            k += 1
        seg = w.plan()
        if seg is None:  # idle until the next arrival (or now)
            if k < arrive.size:
                t = float(arrive[k])
                continue
            end = max(t, 0.0)
            break
        base, growth = seg.base_growth_ms(model)
        if base <= 0.0 and growth <= 0.0:  # a model that prices nothing: no time passes
            end = 0.0
            break
        horizon = min(0.0, float(arrive[k])) if k < arrive.size else 0.0
        m = seg.steps_within(model, horizon - t)
        if m == 0:  # the next step starts before the horizon and ends after it: it runs
            m = 1
        t += seg.total_ms(model, m)
        done = w.apply(seg, m)
        if t >= 0.0:
            end = t
            break
        if done.finished.size:  # only finished requests can (residents never do)
            w.remove(done.finished)
            gone = set(done.finished.tolist())
            rows = [r for j, r in enumerate(rows) if j not in gone]
    prefilled = state.prefilled_tokens.copy()
    decoded = state.decoded_tokens.copy()
    for r, i in enumerate(rows):
        if i < 0 or not waiting[i]:
            continue
        p = int(min(w.prefilled[r], state.prompt_tokens[i]))
        if p >= state.prompt_tokens[i]:
            decoded[i] = 1
        prefilled[i] = p
    out = np.maximum(state.predicted_output_tokens, decoded + 1)
    return InstanceState(state.prompt_tokens, prefilled, decoded, out), float(end)


def with_conditional_lengths(state: InstanceState, finished: RecentFinished | None) -> InstanceState:
    """``state`` with each decoding resident's predicted output length conditioned on what it
    has decoded, over the output lengths of the requests that left the instance recently
    (``routing.length.conditional_output_tokens``: the empirical mean residual life, or the
    resident's own prediction where that is longer, too few finished or it has decoded
    nothing)."""
    if state.n == 0 or finished is None or finished.n == 0:
        return state
    out = conditional_output_tokens(
        state.decoded_tokens, state.predicted_output_tokens, finished.output_tokens
    )
    if np.array_equal(out, state.predicted_output_tokens):
        return state
    return InstanceState(state.prompt_tokens, state.prefilled_tokens, state.decoded_tokens, out)
