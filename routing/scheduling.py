"""Continuous-batching scheduling policies, written once for SFS and the simulated engine.

Paper A, SFS step 2 ("simulate, deterministically, the framework's continuous batching and
scheduling policy, including chunked prefill"); DESIGN.md, "Scheduling policies".

Policies (``SchedulerConfig.policy``):

* ``vllm-v1``: one token budget ``max_num_batched_tokens`` per step. Running requests first,
  in admission order, each taking what it still needs (1 token for a decode, the rest of its
  prompt for a prefill) capped by the budget left (chunked prefill); then waiting requests
  FCFS while budget, ``max_num_seqs`` and KV blocks allow. When the KV cache (``kv_blocks``
  of ``block_size_tokens``) cannot hold the next step, the latest running request is
  preempted by recompute. A row's cached prefix (``Workload.hit``: its own prefix-cache
  hit, at least ``shared_prefix_tokens``) is skipped at admission (vLLM always recomputes
  at least the last prompt token); the caller (engine or SFS) keeps ``hit`` of waiting rows
  up to date with its cache.
* ``sarathi``: Sarathi-Serve: a fixed per-step budget ``chunk_size_tokens``, decodes first,
  then running prefill chunks, then new requests.
* ``vllm-v0``: prefill-first without chunking: whenever waiting requests fit (whole prompts
  within ``max_num_batched_tokens``; a longer lone prompt runs alone), the step is those
  prefills only; otherwise a decode step of every running request.

Instead of stepping token by token, :meth:`Workload.plan` returns a :class:`Segment`: the
batch composition and how many consecutive steps keep it (every row is scheduled the same
number of tokens each step; a prefill can complete and a decode can finish only on the
segment's last step). Per-step features then grow arithmetically, so Eq. 9 sums in closed
form over a segment (:meth:`Segment.total_ms`) and the engine prices its steps as one
vector.

Long context: one request never holds more than the KV cache (``kv_blocks`` x
``block_size_tokens`` = :func:`kv_capacity_tokens`): a row's prompt is at most that less
one token, and its output is cut where prompt + output reaches it (vLLM stops a request at
its context limit with ``finish_reason: length``; it refuses to start with a
``--max-model-len`` its cache cannot hold, and rejects a longer prompt). The engine
rejects such prompts on submit and SFS prices them as never servable (a :class:`Workload`
refuses them with a :class:`SchedulingError`; SFS clamps a snapshot's residents that
disagree with the configuration). Then a lone request always
fits, and requests that fit alone but not together wait or are preempted as in vLLM.

Simplifications (documented, shared by SFS and the engine so they agree exactly): rows are
kept in arrival order and running order is arrival order (vLLM re-appends a re-admitted
preempted request at the end); a preempted request is re-queued as a fresh request whose
prompt is its prompt plus the tokens it had generated; KV blocks of a shared prefix are
counted per request (conservative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from routing.steptime import StepTimeModel
from schemas import SchedulerConfig

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]

POLICIES = ("vllm-v1", "sarathi", "vllm-v0")


class SchedulingError(ValueError):
    """The workload cannot be scheduled (e.g. a request needs more KV blocks than exist)."""


def kv_capacity_tokens(sched: SchedulerConfig) -> int:
    """Tokens the whole KV cache holds: the most one request (prompt + output) can use."""
    return sched.kv_blocks * sched.block_size_tokens


@dataclass(frozen=True)
class Segment:
    """``steps`` consecutive engine steps with the same batch composition.

    Only scheduled rows appear: ``rows[i]`` (an index into the workload) is scheduled
    ``tokens[i]`` tokens in each of the steps. A prefill row (``is_prefill[i]``) attends to
    ``ctx0[i] + j * tokens[i]`` cached tokens at step ``j`` (0-based); a decode row to
    ``ctx0[i] + j``. ``start_prefilled[i]`` is its prompt progress on the first step (prefix
    hits applied).
    """

    steps: int
    rows: IntArray
    tokens: IntArray
    is_prefill: BoolArray
    ctx0: IntArray
    start_prefilled: IntArray
    n_admitted: int  # waiting rows admitted on the first step
    n_running: int  # running rows after the first step's admissions
    n_waiting: int  # rows still waiting after it
    kv_blocks_used: int  # KV blocks held after the first step
    n_tokens: int
    n_decode: int
    n_prefill: int
    decode_ctx0: float  # sum of decode contexts on step 0
    attn0: float  # sum of q * (q / 2 + ctx) over prefill chunks on step 0
    q2: float  # sum of q^2 over prefill chunks: growth of attn per step
    preempted: bool = False  # the first step preempted someone (so it admitted no one)

    @property
    def n_seqs(self) -> int:
        return self.n_decode + self.n_prefill

    def step_features(self, steps: int | None = None) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Eq. 9 features ``(N, sum decode ctx, sum q(q/2+ctx))`` of the first ``steps`` steps."""
        m = self.steps if steps is None else steps
        j = np.arange(m, dtype=np.float64)
        n = np.full(m, float(self.n_tokens))
        return n, self.decode_ctx0 + self.n_decode * j, self.attn0 + self.q2 * j

    def base_growth_ms(self, model: StepTimeModel) -> tuple[float, float]:
        """Eq. 9 step time is ``base + growth * j`` on step ``j`` of the segment."""
        base = (
            model.c0_ms
            + model.c1_ms_per_token * self.n_tokens
            + model.c2_ms_per_ctx_token * self.decode_ctx0
            + model.c3_ms_per_attn_unit * self.attn0
        )
        growth = model.c2_ms_per_ctx_token * self.n_decode + model.c3_ms_per_attn_unit * self.q2
        return base, growth

    def total_ms(self, model: StepTimeModel, steps: int | None = None) -> float:
        """Eq. 9 summed over the first ``steps`` steps, in closed form."""
        m = self.steps if steps is None else steps
        base, growth = self.base_growth_ms(model)
        return m * base + growth * (m * (m - 1) / 2.0)

    def steps_within(self, model: StepTimeModel, span_ms: float) -> int:
        """The most whole steps of the segment whose Eq. 9 total fits in ``span_ms`` (the
        inverse of :meth:`total_ms`), at most ``steps``."""
        if span_ms <= 0.0:
            return 0
        base, growth = self.base_growth_ms(model)
        if growth > 0.0:
            b = base - growth / 2.0
            m = int((-b + math.sqrt(b * b + 2.0 * growth * span_ms)) / growth)
        else:
            m = int(span_ms / base) if base > 0.0 else self.steps
        m = min(max(m, 0), self.steps)
        while m > 0 and self.total_ms(model, m) > span_ms + 1e-9:  # the root rounded up
            m -= 1
        while m < self.steps and self.total_ms(model, m + 1) <= span_ms + 1e-9:  # or down
            m += 1
        return m


@dataclass(frozen=True)
class Applied:
    """What happened when steps of a segment ran: rows that got their first token / finished."""

    first_token: IntArray
    finished: IntArray


def _servable_prompts(prompt: IntArray, cap_tokens: int) -> IntArray:
    """Prompts as rows (at least 1 token); one the KV cache cannot hold is an error."""
    p = np.maximum(np.asarray(prompt, dtype=np.int64), 1)
    bad = np.flatnonzero(p + 1 > cap_tokens)
    if bad.size:
        i = int(bad[0])
        raise SchedulingError(
            f"request {i}: a prompt of {int(p[i])} tokens leaves no room for an output token "
            f"in a KV cache of {cap_tokens} tokens; refuse it before scheduling"
        )
    return p


_BIG = np.iinfo(np.int64).max
_EMPTY = np.zeros(0, dtype=np.int64)


class Workload:
    """Requests on one instance, in arrival order, with the progress the scheduler needs.

    ``prompt``: tokens to prefill; ``prefilled``: tokens in the KV cache from the prompt
    (0 = waiting); ``decoded``: output tokens produced (the first comes with the last
    prefill chunk); ``output``: output tokens the request will produce in all (oracle or
    predicted). Arrays are owned and mutated in place by :meth:`apply`.
    """

    __slots__ = ("prompt", "prefilled", "decoded", "output", "hit", "sched", "_budget", "_prefix")

    def __init__(
        self,
        prompt: IntArray,
        prefilled: IntArray,
        decoded: IntArray,
        output: IntArray,
        sched: SchedulerConfig,
    ) -> None:
        cap = kv_capacity_tokens(sched)
        self.prompt = _servable_prompts(prompt, cap)
        self.prefilled = np.minimum(np.asarray(prefilled, dtype=np.int64), self.prompt)
        dec = np.asarray(decoded, dtype=np.int64)
        # a finished prefill has produced its first token
        self.decoded = np.where((self.prefilled == self.prompt) & (dec < 1), 1, dec)
        # a resident that already produced its predicted length will still emit one more
        self.output = np.maximum(
            np.asarray(output, dtype=np.int64),
            np.where(self.prefilled == self.prompt, self.decoded + 1, 1),
        )
        self.output = np.maximum(np.minimum(self.output, cap - self.prompt), 1)
        self.decoded = np.minimum(self.decoded, self.output - 1)
        self.hit = np.zeros_like(self.prompt)  # prefix-cache hit tokens at admission
        self.sched = sched
        if sched.policy not in POLICIES:
            raise SchedulingError(f"unknown scheduling policy {sched.policy!r}; known: {POLICIES}")
        self._budget = (
            sched.chunk_size_tokens if sched.policy == "sarathi" else sched.max_num_batched_tokens
        )
        self._prefix = sched.shared_prefix_tokens

    @property
    def n(self) -> int:
        return int(self.prompt.size)

    def copy(self) -> Workload:
        w = Workload.__new__(Workload)
        w.prompt = self.prompt.copy()
        w.prefilled = self.prefilled.copy()
        w.decoded = self.decoded.copy()
        w.output = self.output.copy()
        w.hit = self.hit.copy()
        w.sched = self.sched
        w._budget = self._budget
        w._prefix = self._prefix
        return w

    def append(self, prompt: IntArray, output: IntArray, hit: IntArray | None = None) -> None:
        """Add new waiting requests at the end of the FCFS queue (outputs cut at the KV
        cache: see the module docstring)."""
        cap = kv_capacity_tokens(self.sched)
        p = _servable_prompts(prompt, cap)
        out = np.clip(np.asarray(output, np.int64), 1, np.maximum(cap - p, 1))
        self.prompt = np.concatenate([self.prompt, p])
        self.prefilled = np.concatenate([self.prefilled, np.zeros_like(p)])
        self.decoded = np.concatenate([self.decoded, np.zeros_like(p)])
        self.output = np.concatenate([self.output, out])
        h = np.zeros_like(p) if hit is None else np.asarray(hit, dtype=np.int64)
        self.hit = np.concatenate([self.hit, h])

    def remove(self, rows: IntArray) -> None:
        keep = np.ones(self.n, dtype=bool)
        keep[rows] = False
        self.prompt = self.prompt[keep]
        self.prefilled = self.prefilled[keep]
        self.decoded = self.decoded[keep]
        self.output = self.output[keep]
        self.hit = self.hit[keep]

    def _preempt(self, row: int) -> None:
        # recompute: drop the KV cache; re-prefill prompt + generated tokens, then go on
        d = int(self.decoded[row])
        self.prompt[row] += d
        self.output[row] = max(int(self.output[row]) - d, 1)
        self.prefilled[row] = 0
        self.decoded[row] = 0

    def plan(self) -> Segment | None:
        """The next segment, or None when there is nothing to run. May preempt (mutates)."""
        if self.prompt.size == 0:
            return None
        if self.sched.policy == "vllm-v0":
            return self._plan_v0()
        sched = self.sched
        bs = sched.block_size_tokens
        budget = self._budget
        prompt, pre = self.prompt, self.prefilled
        if budget >= prompt.size and (pre == prompt).all():
            seg = self._plan_all_decoding()
            if seg is not None:
                return seg
        preempted = False
        while True:
            run = np.flatnonzero(pre > 0)
            rp = prompt[run]
            rpre = pre[run]
            in_pf = rpre < rp
            if sched.policy == "sarathi" and in_pf.any():
                order = np.argsort(in_pf, kind="stable")  # decodes first
                run, rp, rpre, in_pf = run[order], rp[order], rpre[order], in_pf[order]
            need = np.where(in_pf, rp - rpre, 1)
            cum = np.cumsum(need)
            tok = np.minimum(np.maximum(budget - (cum - need), 0), need)
            cache = np.where(in_pf, rpre, rp + self.decoded[run] - 1)
            blocks_used = int(((cache + tok + (bs - 1)) // bs).sum())
            if blocks_used <= sched.kv_blocks or run.size == 0:
                break
            if run.size == 1:
                raise SchedulingError(
                    f"request needs {blocks_used} KV blocks of {bs} tokens, "
                    f"more than kv_blocks={sched.kv_blocks}"
                )
            self._preempt(int(run.max()))
            preempted = True

        n_run = int(run.size)
        left = budget - int(tok.sum())
        slots = sched.max_num_seqs - n_run
        n_wait = self.prompt.size - n_run
        adm = _EMPTY
        adm_tok = _EMPTY
        adm_start = _EMPTY
        # vLLM V1 admits no waiting request in a step that had to preempt
        if n_wait and left > 0 and slots > 0 and not preempted:
            w = np.flatnonzero(pre == 0)[:slots]
            pw = prompt[w]
            hit = np.minimum(np.maximum(self.hit[w], self._prefix), pw - 1)
            nw = pw - hit
            cw = np.cumsum(nw)
            qw = np.minimum(np.maximum(left - (cw - nw), 0), nw)
            bw = (hit + qw + (bs - 1)) // bs
            ok = (qw > 0) & (np.cumsum(bw) <= sched.kv_blocks - blocks_used)
            m = int(ok.size) if ok.all() else int(np.argmin(ok))
            if m == 0 and n_run == 0:
                raise SchedulingError(
                    f"request needs {int(bw[0])} KV blocks of {bs} tokens, "
                    f"more than kv_blocks={sched.kv_blocks}"
                )
            if m:
                adm, adm_tok, adm_start = w[:m], qw[:m], hit[:m]
                blocks_used += int(bw[:m].sum())
        sel = tok > 0
        rows = np.concatenate([run[sel], adm])
        tokens = np.concatenate([tok[sel], adm_tok])
        start = np.concatenate([rpre[sel], adm_start])
        is_pf = np.concatenate([in_pf[sel], np.ones(adm.size, dtype=bool)])
        ctx0 = np.where(is_pf, start, np.concatenate([cache[sel], adm_start]))
        # blocks of running rows that are not scheduled stay constant over the segment
        fixed_blocks = int(((cache[~sel] + (bs - 1)) // bs).sum())
        return self._segment(
            rows,
            tokens,
            start,
            is_pf,
            ctx0,
            n_admitted=int(adm.size),
            n_running=n_run + int(adm.size),
            n_waiting=n_wait - int(adm.size),
            kv_blocks_used=blocks_used,
            fixed_blocks=fixed_blocks,
            preempted=preempted,
        )

    def _plan_all_decoding(self) -> Segment | None:
        """The common case without a waiting or prefilling request: every row decodes one
        token per step until the first one finishes (None: let the general path decide)."""
        n = self.prompt.size
        bs = self.sched.block_size_tokens
        ctx = self.prompt + self.decoded - 1
        ctx_sum = int(ctx.sum())
        k = max(int((self.output - self.decoded).min()), 1)
        # the KV cache must hold every step of the segment (upper bound; else the general path)
        if (ctx_sum + n * k) // bs + n > self.sched.kv_blocks:
            return None
        blocks = int(((ctx + bs) // bs).sum())
        return Segment(
            steps=k,
            rows=np.arange(n),
            tokens=np.ones(n, dtype=np.int64),
            is_prefill=np.zeros(n, dtype=bool),
            ctx0=ctx,
            start_prefilled=self.prompt.copy(),
            n_admitted=0,
            n_running=n,
            n_waiting=0,
            kv_blocks_used=blocks,
            n_tokens=n,
            n_decode=n,
            n_prefill=0,
            decode_ctx0=float(ctx_sum),
            attn0=0.0,
            q2=0.0,
        )

    def _plan_v0(self) -> Segment | None:
        sched = self.sched
        bs = sched.block_size_tokens
        prompt, pre = self.prompt, self.prefilled
        running = pre > 0
        run = np.flatnonzero(running)
        cache = prompt[run] + self.decoded[run] - 1  # V0 has no partial prefills
        blocks_used = int(((cache + (bs - 1)) // bs).sum())
        n_run = int(run.size)
        slots = sched.max_num_seqs - n_run
        n_wait = self.prompt.size - n_run
        if n_wait and slots > 0:
            w = np.flatnonzero(~running)[:slots]
            pw = prompt[w]
            hit = np.minimum(np.maximum(self.hit[w], self._prefix), pw - 1)
            nw = pw - hit
            bw = (pw + (bs - 1)) // bs
            fits_kv = np.cumsum(bw) <= sched.kv_blocks - blocks_used
            ok = (np.cumsum(nw) <= self._budget) & fits_kv
            ok[0] = bool(fits_kv[0])  # a prompt longer than the budget runs alone
            m = int(ok.size) if ok.all() else int(np.argmin(ok))
            if m:
                return self._segment(
                    w[:m],
                    nw[:m],
                    hit[:m],
                    np.ones(m, dtype=bool),
                    hit[:m],
                    n_admitted=m,
                    n_running=n_run + m,
                    n_waiting=n_wait - m,
                    kv_blocks_used=blocks_used + int(bw[:m].sum()),
                    fixed_blocks=blocks_used,
                    preempted=False,
                )
            if n_run == 0:
                raise SchedulingError(
                    f"request needs {int(bw[0])} KV blocks of {bs} tokens, "
                    f"more than kv_blocks={sched.kv_blocks}"
                )
        if n_run == 0:
            return None
        preempted = False
        while True:
            run = np.flatnonzero(self.prefilled > 0)
            cache = self.prompt[run] + self.decoded[run] - 1
            blocks_used = int(((cache + bs) // bs).sum())
            if blocks_used <= sched.kv_blocks or run.size == 1:
                break
            self._preempt(int(run.max()))
            preempted = True
        n_run = int(run.size)
        return self._segment(
            run,
            np.ones(n_run, dtype=np.int64),
            self.prefilled[run],
            np.zeros(n_run, dtype=bool),
            cache,
            n_admitted=0,
            n_running=n_run,
            n_waiting=self.prompt.size - n_run,
            kv_blocks_used=blocks_used,
            fixed_blocks=0,
            preempted=preempted,
        )

    def _segment(
        self,
        rows: IntArray,
        tokens: IntArray,
        start: IntArray,
        is_pf: BoolArray,
        ctx0: IntArray,
        *,
        n_admitted: int,
        n_running: int,
        n_waiting: int,
        kv_blocks_used: int,
        fixed_blocks: int,
        preempted: bool,
    ) -> Segment | None:
        if rows.size == 0:
            return None
        sched = self.sched
        n_pf = int(np.count_nonzero(is_pf))
        n_dec = int(rows.size) - n_pf
        # composition holds while every prefill still needs >= its chunk and no decode ends
        k = _BIG
        if n_pf:
            k = int(((self.prompt[rows[is_pf]] - start[is_pf]) // tokens[is_pf]).min())
        if n_dec:
            dr = rows[~is_pf]
            k = min(k, int((self.output[dr] - self.decoded[dr]).min()))
        k = max(k, 1)
        if sched.policy == "vllm-v0" and n_pf:
            k = 1
        # KV growth: stop the segment before the cache overflows (the next plan preempts)
        if k > 1:
            bs = sched.block_size_tokens
            cache_now = np.where(is_pf, start, ctx0)

            def blocks_after(j: int) -> int:
                return fixed_blocks + int(((cache_now + j * tokens + (bs - 1)) // bs).sum())

            if blocks_after(k) > sched.kv_blocks:
                lo, hi = 1, k  # blocks_after(lo) fits (checked by plan), blocks_after(hi) not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if blocks_after(mid) <= sched.kv_blocks:
                        lo = mid
                    else:
                        hi = mid
                k = lo
        if n_pf:
            qp = tokens[is_pf].astype(np.float64)
            cp = ctx0[is_pf].astype(np.float64)
            attn0 = float((qp * (qp / 2.0 + cp)).sum())
            q2 = float((qp * qp).sum())
        else:
            attn0 = q2 = 0.0
        return Segment(
            steps=k,
            rows=rows,
            tokens=tokens,
            is_prefill=is_pf,
            ctx0=ctx0,
            start_prefilled=start,
            n_admitted=n_admitted,
            n_running=n_running,
            n_waiting=n_waiting,
            kv_blocks_used=kv_blocks_used,
            n_tokens=int(tokens.sum()),
            n_decode=n_dec,
            n_prefill=n_pf,
            decode_ctx0=float(ctx0[~is_pf].sum()) if n_dec else 0.0,
            attn0=attn0,
            q2=q2,
            preempted=preempted,
        )

    def apply(self, seg: Segment, steps: int | None = None) -> Applied:
        """Run the first ``steps`` (default all) steps of ``seg`` on this workload."""
        m = seg.steps if steps is None else steps
        if not 1 <= m <= seg.steps:
            raise ValueError(f"apply: steps must be in [1, {seg.steps}], got {m}")
        pf = seg.is_prefill
        first = _EMPTY
        finished_parts = []
        if seg.n_prefill:
            pr = seg.rows[pf]
            new = seg.start_prefilled[pf] + m * seg.tokens[pf]
            self.prefilled[pr] = new
            first = pr[new >= self.prompt[pr]]
            if first.size:
                self.decoded[first] = 1
                finished_parts.append(first[self.output[first] <= 1])
        if seg.n_decode:
            dr = seg.rows[~pf]
            d = self.decoded[dr] + m
            self.decoded[dr] = d
            finished_parts.append(dr[d >= self.output[dr]])
        if not finished_parts:
            return Applied(first, _EMPTY)
        fin = finished_parts[0] if len(finished_parts) == 1 else np.concatenate(finished_parts)
        return Applied(first, np.sort(fin))
