"""Continuous-batching scheduling policies, written once for SFS and the simulated engine.

Paper A, SFS step 2 ("simulate, deterministically, the framework's continuous batching and
scheduling policy, including chunked prefill"); DESIGN.md, "Scheduling policies".

Policies (``SchedulerConfig.policy``):

* ``vllm-v1``: one token budget ``max_num_batched_tokens`` per step. Running requests first,
  in admission order, each taking what it still needs (1 token for a decode, the rest of its
  prompt for a prefill) capped by the budget left (chunked prefill); then waiting requests
  FCFS while budget, ``max_num_seqs`` and KV blocks allow. When the KV cache (``kv_blocks``
  of ``block_size_tokens``) cannot hold the next step, the latest running request is
  preempted by recompute. A shared prefix of ``shared_prefix_tokens`` is a prefix-cache hit
  at admission (vLLM always recomputes at least the last prompt token).
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

Simplifications (documented, shared by SFS and the engine so they agree exactly): rows are
kept in arrival order and running order is arrival order (vLLM re-appends a re-admitted
preempted request at the end); a preempted request is re-queued as a fresh request whose
prompt is its prompt plus the tokens it had generated; KV blocks of a shared prefix are
counted per request (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class Segment:
    """``steps`` consecutive engine steps with the same batch composition.

    ``tokens[i]`` is what row ``i`` is scheduled in each of those steps (0: not scheduled).
    Prefill rows (``is_prefill``) attend to ``ctx0[i] + j * tokens[i]`` cached tokens at
    step ``j`` (0-based); decode rows attend to ``ctx0[i] + j``.
    """

    steps: int
    tokens: IntArray
    is_prefill: BoolArray
    is_decode: BoolArray
    ctx0: IntArray
    admitted: BoolArray  # waiting rows admitted on the first step
    start_prefilled: (
        IntArray  # prefilled tokens of every row on the first step (prefix hits applied)
    )
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


@dataclass(frozen=True)
class Applied:
    """What happened when steps of a segment ran: rows that got their first token / finished."""

    first_token: IntArray
    finished: IntArray


def _ceil_div(a: IntArray, b: int) -> IntArray:
    return -(-a // b)


class Workload:
    """Requests on one instance, in arrival order, with the progress the scheduler needs.

    ``prompt``: tokens to prefill; ``prefilled``: tokens in the KV cache from the prompt
    (0 = waiting); ``decoded``: output tokens produced (the first comes with the last
    prefill chunk); ``output``: output tokens the request will produce in all (oracle or
    predicted). Arrays are owned and mutated in place by :meth:`apply`.
    """

    __slots__ = ("prompt", "prefilled", "decoded", "output", "sched", "_budget", "_prefix")

    def __init__(
        self,
        prompt: IntArray,
        prefilled: IntArray,
        decoded: IntArray,
        output: IntArray,
        sched: SchedulerConfig,
    ) -> None:
        self.prompt = np.maximum(np.asarray(prompt, dtype=np.int64), 1)
        self.prefilled = np.minimum(np.asarray(prefilled, dtype=np.int64), self.prompt)
        self.output = np.maximum(np.asarray(output, dtype=np.int64), 1)
        dec = np.asarray(decoded, dtype=np.int64)
        # a finished prefill has produced its first token
        self.decoded = np.where((self.prefilled == self.prompt) & (dec < 1), 1, dec)
        # a resident that already produced its predicted length will still emit one more
        self.output = np.maximum(self.output, self.decoded + (self.prefilled == self.prompt))
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
        w.sched = self.sched
        w._budget = self._budget
        w._prefix = self._prefix
        return w

    def append(self, prompt: IntArray, output: IntArray) -> None:
        """Add new waiting requests at the end of the FCFS queue."""
        p = np.maximum(np.asarray(prompt, dtype=np.int64), 1)
        self.prompt = np.concatenate([self.prompt, p])
        self.prefilled = np.concatenate([self.prefilled, np.zeros_like(p)])
        self.decoded = np.concatenate([self.decoded, np.zeros_like(p)])
        self.output = np.concatenate([self.output, np.maximum(np.asarray(output, np.int64), 1)])

    def remove(self, rows: IntArray) -> None:
        keep = np.ones(self.n, dtype=bool)
        keep[rows] = False
        self.prompt = self.prompt[keep]
        self.prefilled = self.prefilled[keep]
        self.decoded = self.decoded[keep]
        self.output = self.output[keep]

    def _preempt(self, row: int) -> None:
        # recompute: drop the KV cache, re-prefill prompt + generated tokens, then go on
        d = int(self.decoded[row])
        self.prompt[row] += d
        self.output[row] = max(int(self.output[row]) - d, 1)
        self.prefilled[row] = 0
        self.decoded[row] = 0

    def _cache(self) -> IntArray:
        """Tokens each row holds in the KV cache before the next step."""
        return np.where(
            self.prefilled < self.prompt, self.prefilled, self.prompt + self.decoded - 1
        )

    def plan(self) -> Segment | None:
        """The next segment, or None when there is nothing to run. May preempt (mutates)."""
        n = self.n
        if n == 0:
            return None
        if self.sched.policy == "vllm-v0":
            return self._plan_v0()
        sched = self.sched
        bs = sched.block_size_tokens
        preempted = False
        while True:
            running = self.prefilled > 0
            run_idx = np.flatnonzero(running)
            in_prefill = self.prefilled < self.prompt
            need = np.where(in_prefill, self.prompt - self.prefilled, 1)
            if self.sched.policy == "sarathi" and run_idx.size:
                run_idx = np.concatenate(
                    [run_idx[~in_prefill[run_idx]], run_idx[in_prefill[run_idx]]]
                )
            tokens = np.zeros(n, dtype=np.int64)
            nr = need[run_idx]
            cum = np.cumsum(nr)
            tokens[run_idx] = np.clip(self._budget - (cum - nr), 0, nr)
            cache = self._cache()
            cache = np.where(running, cache, 0)
            blocks_used = int(_ceil_div(cache + tokens, bs).sum())
            if blocks_used <= sched.kv_blocks or run_idx.size == 0:
                break
            victim = int(run_idx.max())
            if run_idx.size == 1:
                raise SchedulingError(
                    f"request needs {blocks_used} KV blocks of {bs} tokens, "
                    f"more than kv_blocks={sched.kv_blocks}"
                )
            self._preempt(victim)
            preempted = True

        start_prefilled = self.prefilled.copy()
        admitted = np.zeros(n, dtype=bool)
        left = self._budget - int(tokens.sum())
        slots = sched.max_num_seqs - int(run_idx.size)
        wait_idx = np.flatnonzero(~running)
        # vLLM V1 admits no waiting request in a step that had to preempt
        if wait_idx.size and left > 0 and slots > 0 and not preempted:
            w = wait_idx[:slots]
            hit = np.minimum(self._prefix, self.prompt[w] - 1) if self._prefix else 0
            nw = self.prompt[w] - hit
            cw = np.cumsum(nw)
            qw = np.clip(left - (cw - nw), 0, nw)
            bw = _ceil_div(hit + qw, bs)
            ok = (qw > 0) & (np.cumsum(bw) <= sched.kv_blocks - blocks_used)
            first_bad = np.flatnonzero(~ok)
            m = int(first_bad[0]) if first_bad.size else int(w.size)
            if m == 0 and run_idx.size == 0:
                raise SchedulingError(
                    f"request needs {int(bw[0])} KV blocks of {bs} tokens, "
                    f"more than kv_blocks={sched.kv_blocks}"
                )
            adm = w[:m]
            tokens[adm] = qw[:m]
            admitted[adm] = True
            if self._prefix:
                start_prefilled[adm] = np.asarray(hit)[:m] if np.ndim(hit) else hit
        seg = self._segment(tokens, start_prefilled, admitted, blocks_used)
        if seg is not None and preempted:
            seg = replace(seg, preempted=True)
        return seg

    def _plan_v0(self) -> Segment | None:
        sched = self.sched
        bs = sched.block_size_tokens
        n = self.n
        running = self.prefilled > 0
        cache = np.where(running, self._cache(), 0)
        blocks_used = int(_ceil_div(cache, bs).sum())
        wait_idx = np.flatnonzero(~running)
        slots = sched.max_num_seqs - int(running.sum())
        tokens = np.zeros(n, dtype=np.int64)
        start_prefilled = self.prefilled.copy()
        admitted = np.zeros(n, dtype=bool)
        if wait_idx.size and slots > 0:
            w = wait_idx[:slots]
            hit = (
                np.minimum(self._prefix, self.prompt[w] - 1)
                if self._prefix
                else np.zeros(w.size, np.int64)
            )
            nw = self.prompt[w] - hit
            bw = _ceil_div(self.prompt[w], bs)
            fits_kv = np.cumsum(bw) <= sched.kv_blocks - blocks_used
            ok = (np.cumsum(nw) <= self._budget) & fits_kv
            ok[0] = bool(fits_kv[0])  # a prompt longer than the budget runs alone
            first_bad = np.flatnonzero(~ok)
            m = int(first_bad[0]) if first_bad.size else int(w.size)
            if m:
                adm = w[:m]
                tokens[adm] = nw[:m]
                admitted[adm] = True
                start_prefilled[adm] = hit[:m]
                return self._segment(tokens, start_prefilled, admitted, blocks_used)
            if not running.any():
                raise SchedulingError(
                    f"request needs {int(bw[0])} KV blocks of {bs} tokens, "
                    f"more than kv_blocks={sched.kv_blocks}"
                )
        if not running.any():
            return None
        while True:
            run_idx = np.flatnonzero(self.prefilled > 0)
            cache = self._cache()[run_idx]
            if int(_ceil_div(cache + 1, bs).sum()) <= sched.kv_blocks or run_idx.size == 1:
                break
            self._preempt(int(run_idx.max()))
        tokens[run_idx] = 1
        return self._segment(
            tokens, self.prefilled.copy(), admitted, int(_ceil_div(cache, bs).sum())
        )

    def _segment(
        self, tokens: IntArray, start_prefilled: IntArray, admitted: BoolArray, blocks_used: int
    ) -> Segment | None:
        sched = self.sched
        sched_rows = tokens > 0
        if not sched_rows.any():
            return None
        is_prefill = sched_rows & (start_prefilled < self.prompt)
        is_decode = sched_rows & ~is_prefill
        rem_prefill = self.prompt - start_prefilled
        q = tokens
        # composition holds while every prefill still needs >= its chunk and no decode ends
        k_pref = np.where(is_prefill, rem_prefill // np.maximum(q, 1), np.iinfo(np.int64).max)
        k_dec = np.where(is_decode, self.output - self.decoded, np.iinfo(np.int64).max)
        k = int(min(k_pref.min(), k_dec.min()))
        k = max(k, 1)
        if self.sched.policy == "vllm-v0" and is_prefill.any():
            k = 1
        ctx0 = np.where(is_prefill, start_prefilled, self.prompt + self.decoded - 1)
        ctx0 = np.where(sched_rows, ctx0, 0)
        # KV growth: stop the segment before the cache overflows (the next plan preempts)
        bs = sched.block_size_tokens
        if k > 1:
            cache_now = np.where(self.prefilled > 0, self._cache(), 0)
            cache_now = np.where(admitted, start_prefilled, cache_now)

            def blocks_after(j: int) -> int:
                return int(_ceil_div(cache_now + j * tokens, bs).sum())

            if blocks_after(k) > sched.kv_blocks:
                lo, hi = 1, k  # blocks_after(lo) fits (checked by plan), blocks_after(hi) not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if blocks_after(mid) <= sched.kv_blocks:
                        lo = mid
                    else:
                        hi = mid
                k = lo
        qp = np.where(is_prefill, q, 0).astype(np.float64)
        cp = ctx0[is_prefill].astype(np.float64)
        qpp = qp[is_prefill]
        return Segment(
            steps=k,
            tokens=tokens,
            is_prefill=is_prefill,
            is_decode=is_decode,
            ctx0=ctx0,
            admitted=admitted,
            start_prefilled=start_prefilled,
            n_tokens=int(tokens.sum()),
            n_decode=int(is_decode.sum()),
            n_prefill=int(is_prefill.sum()),
            decode_ctx0=float(ctx0[is_decode].sum()),
            attn0=float((qpp * (qpp / 2.0 + cp)).sum()),
            q2=float((qpp * qpp).sum()),
        )

    def apply(self, seg: Segment, steps: int | None = None) -> Applied:
        """Run the first ``steps`` (default all) steps of ``seg`` on this workload."""
        m = seg.steps if steps is None else steps
        if not 1 <= m <= seg.steps:
            raise ValueError(f"apply: steps must be in [1, {seg.steps}], got {m}")
        pre = seg.is_prefill
        self.prefilled = np.where(pre, seg.start_prefilled + m * seg.tokens, self.prefilled)
        done_prefill = pre & (self.prefilled >= self.prompt)
        self.decoded = np.where(seg.is_decode, self.decoded + m, self.decoded)
        self.decoded = np.where(done_prefill, 1, self.decoded)
        finished = (seg.is_decode | done_prefill) & (self.decoded >= self.output)
        return Applied(np.flatnonzero(done_prefill), np.flatnonzero(finished))
