"""A simulated vLLM instance in virtual time (DESIGN.md, "sim/"; issue 3, "Simulated engine").

The engine runs the same scheduling policies as SFS (``routing.scheduling``) on the
requests it was given, with their *real* output lengths, and prices each step with a
:class:`~sim.timing.TimingSource` (measured tables plus noise, or Eq. 9 itself).
It is event-driven: it jumps from one change of batch composition to the next, pricing the
steps in between as one vector, and stops at the caller's clock.

Usage (a cluster simulator or an HTTP front end drives it)::

    eng = SimEngine(timing, sched, seed=0)
    eng.submit("q1", arrival_s=0.0, prompt_tokens=900, output_tokens=120,
               predicted_output_tokens=100)
    t = eng.next_event_s()          # when the next step ends (None: idle)
    events = eng.advance_to(t)      # first tokens / completions with time <= t
    state = eng.snapshot()          # InstanceState for SFS (predicted lengths)

Long context, as vLLM: a request's tokens (prompt + output) never exceed the engine's
context, ``max_model_len`` if given and never more than the KV cache holds. A prompt that
leaves no room for one output token is refused on submit (:class:`RequestRejected`, vLLM's
HTTP 400); a longer output is cut at the limit (``finish_reason: length``). Requests that
fit alone but not together wait, or are preempted (``routing.scheduling``).

Prefix caching (vLLM's automatic prefix caching, ``sim.prefix_cache``): a request submitted
with its prefix block hashes prefills only what the engine's cache does not hold when it is
admitted; its prompt blocks are cached once its prefill is done, and are evicted, least
recently freed first, only when the KV cache needs the room. ``prefix_cache_queries`` /
``prefix_cache_hits`` count prompt tokens looked up and found, like vLLM's counters.

Time semantics: ``advance_to(t)`` runs every step that *starts* before ``t``. A step in
flight at ``t`` has already been applied to the state (``snapshot()`` shows the state
after it, and ``busy_until_s()`` says when it ends), but its events are reported only once
the caller's clock reaches their time. A request submitted at ``t`` joins the first step
that starts at or after ``t``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from routing.prefix import full_blocks
from routing.scheduling import Segment, Workload, kv_capacity_tokens
from routing.types import InstanceState
from schemas import InstanceSnapshot, ResidentRequest, SchedulerConfig
from sim.prefix_cache import EnginePrefixCache
from sim.timing import TimingSource

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class RequestRejected(ValueError):
    """The engine refuses a request it can never hold (the message names both sizes)."""


@dataclass(frozen=True)
class RequestRecord:
    """One finished request. Times in seconds of virtual time."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float
    finish_s: float
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class EngineEvent:
    """Something observable: a request's first token, or its completion."""

    kind: Literal["first_token", "finished"]
    request_id: str
    t_s: float
    cached_tokens: int = 0  # finished: prompt tokens its admission found in the prefix cache


@dataclass(frozen=True)
class StepLog:
    """Features and durations of executed steps (for recalibrating Eq. 9)."""

    n_tokens: FloatArray
    decode_ctx_tokens: FloatArray
    prefill_attn_units: FloatArray
    duration_ms: FloatArray


class SimEngine:
    """One vLLM instance in virtual time. Deterministic given ``seed``."""

    def __init__(
        self,
        timing: TimingSource,
        sched: SchedulerConfig,
        seed: int = 0,
        *,
        instance_id: str = "sim-0",
        model: str = "sim",
        record_steps: bool = False,
        start_s: float = 0.0,
        max_model_len: int | None = None,
    ) -> None:
        self.timing = timing
        self.sched = sched
        kv = kv_capacity_tokens(sched)
        self.context_tokens = kv if max_model_len is None else min(max_model_len, kv)
        self.instance_id = instance_id
        self.model = model
        self._rng = np.random.default_rng(seed)
        z = np.zeros(0, dtype=np.int64)
        self._w = Workload(z, z, z, z, sched)
        self._ids: list[str] = []
        self._arrival = np.zeros(0)
        self._first = np.zeros(0)
        self._predicted = np.zeros(0, dtype=np.int64)
        self._prompt0 = np.zeros(0, dtype=np.int64)
        self._output0 = np.zeros(0, dtype=np.int64)
        self.prefix_cache = EnginePrefixCache()
        self._hashes: list[list[int]] = []  # per row: prefix block hashes
        self._block_tokens: list[float] = []  # per row: tokens per block
        self._held = np.zeros(0, dtype=np.int64)  # per row: leading blocks it holds
        self._lead = np.zeros(0, dtype=np.int64)  # per waiting row: leading blocks cached
        self._cached0 = np.zeros(0, dtype=np.int64)  # per row: hit tokens at first admission
        self._seen_version = -1
        self._n_hashed = 0  # rows that came with prefix hashes
        self._clock = float(start_s)  # when the next step may start
        self._now = float(start_s)  # the caller's clock
        self._pending: list[EngineEvent] = []
        self.finished: list[RequestRecord] = []
        self.steps_run = 0
        self.segments_run = 0
        self.preempting_steps = 0  # steps that preempted a request (KV cache full)
        self._plan: tuple[Segment, FloatArray, FloatArray] | None = None
        self._record_steps = record_steps
        self._log: list[tuple[FloatArray, FloatArray, FloatArray, FloatArray]] = []

    # ---- inputs -----------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
        predicted_output_tokens: int | None = None,
        prefix_hashes: list[int] | None = None,
        prefix_block_tokens: float = 512.0,
    ) -> None:
        """Queue a request arriving at ``arrival_s`` (must not be before the engine's clock).

        ``prefix_hashes``: its prompt's chained block hashes, ``prefix_block_tokens`` tokens
        each (``schemas.prefix``); None: it neither hits nor fills the prefix cache."""
        if arrival_s < self._now - 1e-9:
            raise ValueError(
                f"submit {request_id!r}: arrival_s={arrival_s} is before the engine clock {self._now}"
            )
        if prompt_tokens < 0:
            raise ValueError(
                f"submit {request_id!r}: prompt_tokens must be >= 0, got {prompt_tokens}"
            )
        if output_tokens < 1:
            raise ValueError(
                f"submit {request_id!r}: output_tokens must be >= 1, got {output_tokens}"
            )
        pred = output_tokens if predicted_output_tokens is None else predicted_output_tokens
        if pred < 1:
            raise ValueError(
                f"submit {request_id!r}: predicted_output_tokens must be >= 1, got {pred}"
            )
        if max(prompt_tokens, 1) + 1 > self.context_tokens:
            raise RequestRejected(
                f"request {request_id!r}: prompt of {prompt_tokens} tokens leaves no room for "
                f"an output token in this engine's context of {self.context_tokens} tokens"
            )
        output_tokens = min(output_tokens, self.context_tokens - max(prompt_tokens, 1))
        self.advance_to(arrival_s, collect=False)
        self._plan = None  # the next step will see this request
        if self._w.n == 0:
            self._clock = max(self._clock, arrival_s)
        self._w.append(np.array([prompt_tokens]), np.array([output_tokens]))
        self._ids.append(request_id)
        self._arrival = np.append(self._arrival, arrival_s)
        self._first = np.append(self._first, np.nan)
        self._predicted = np.append(self._predicted, pred)
        self._prompt0 = np.append(self._prompt0, max(prompt_tokens, 1))
        self._output0 = np.append(self._output0, output_tokens)
        self._hashes.append(list(prefix_hashes or ()))
        self._n_hashed += bool(prefix_hashes)
        self._block_tokens.append(float(prefix_block_tokens))
        self._held = np.append(self._held, 0)
        self._lead = np.append(self._lead, 0)
        self._cached0 = np.append(self._cached0, -1)
        self._seen_version = -1  # a new waiting row: look its prefix up

    # ---- time -------------------------------------------------------------------------
    def next_event_s(self) -> float | None:
        """Upper bound on the next event's time: a held-back event, else the end of the next
        segment (the run of steps until the batch composition changes). None when idle.

        Calling ``advance_to(next_event_s())`` repeatedly drives the engine segment by
        segment; a segment may end without an event (e.g. a prefill chunk pattern changes).
        """
        if self._pending:
            return min(e.t_s for e in self._pending)
        planned = self._planned()
        if planned is None:
            return None
        _, ends = planned
        return float(ends[-1])

    def _planned(self) -> tuple[Segment, FloatArray] | None:
        """The next segment and its steps' end times (cached until the workload changes)."""
        if self._plan is None:
            if self._w.n == 0:
                return None
            caching = self._caching()
            if caching:
                self._refresh_hits()
            seg = self._w.plan()
            if caching:
                self._release_preempted()
            if seg is None:
                return None
            dur_ms = self.timing.segment_ms(seg, seg.steps, self._rng)
            self._plan = (seg, self._clock + np.cumsum(dur_ms) / 1000.0, dur_ms)
        return self._plan[0], self._plan[1]

    def busy_until_s(self) -> float:
        """When the step in flight ends (the caller's clock if idle)."""
        return max(self._clock, self._now)

    def advance_to(self, t_s: float, *, collect: bool = True) -> list[EngineEvent]:
        """Run every step that starts before ``t_s``; return events with time <= ``t_s``."""
        if t_s < self._now - 1e-9:
            raise ValueError(f"advance_to({t_s}) is before the engine clock {self._now}")
        self._now = max(self._now, t_s)
        w = self._w
        while w.n and self._clock < t_s:
            planned = self._planned()
            if planned is None or self._plan is None:
                break
            seg, ends, dur_ms = self._plan
            self._plan = None
            starts = np.concatenate([[self._clock], ends[:-1]])
            m = int(np.searchsorted(starts, t_s, side="left"))
            m = max(1, min(m, seg.steps))
            if self._record_steps:
                n, d, a = seg.step_features(m)
                self._log.append((n, d, a, np.asarray(dur_ms[:m], dtype=np.float64)))
            done = w.apply(seg, m)
            if self._caching():
                self._cache_blocks(seg)
            self.preempting_steps += int(seg.preempted)
            self.steps_run += m
            self.segments_run += 1
            self._clock = float(ends[m - 1])
            t_end = self._clock
            for r in done.first_token.tolist():
                if math.isnan(self._first[r]):
                    self._first[r] = t_end
                    self._pending.append(EngineEvent("first_token", self._ids[r], t_end))
            if done.finished.size:
                self._finish(done.finished, t_end)
            if self._caching():
                self._evict()
        if not w.n:
            self._clock = max(self._clock, self._now)
        if not collect or not self._pending:
            return []
        ready = [e for e in self._pending if e.t_s <= t_s + 1e-12]
        if ready:
            self._pending = [e for e in self._pending if e.t_s > t_s + 1e-12]
        return ready

    def run_until_idle(self) -> list[EngineEvent]:
        """Run everything queued to completion; return all events."""
        events: list[EngineEvent] = []
        while self._w.n or self._pending:
            t = self.next_event_s()
            if t is None:
                break
            events.extend(self.advance_to(max(t, self._now)))
        return events

    def _finish(self, rows: IntArray, t_end: float) -> None:
        for r in rows.tolist():
            self.finished.append(
                RequestRecord(
                    request_id=self._ids[r],
                    arrival_s=float(self._arrival[r]),
                    prompt_tokens=int(self._prompt0[r]),
                    output_tokens=int(self._output0[r]),
                    first_token_s=float(self._first[r]),
                    finish_s=t_end,
                    preemptions=int(self._w.prompt[r] != self._prompt0[r]),
                    cached_tokens=max(int(self._cached0[r]), 0),
                )
            )
            self._pending.append(
                EngineEvent("finished", self._ids[r], t_end, max(int(self._cached0[r]), 0))
            )
            if self._held[r]:
                self.prefix_cache.release(self._hashes[r][: int(self._held[r])])
            self._n_hashed -= bool(self._hashes[r])
        self._w.remove(rows)
        keep = np.ones(len(self._ids), dtype=bool)
        keep[rows] = False
        self._ids = [i for i, k in zip(self._ids, keep.tolist(), strict=True) if k]
        self._arrival = self._arrival[keep]
        self._first = self._first[keep]
        self._predicted = self._predicted[keep]
        self._prompt0 = self._prompt0[keep]
        self._output0 = self._output0[keep]
        self._hashes = [h for h, k in zip(self._hashes, keep.tolist(), strict=True) if k]
        self._block_tokens = [b for b, k in zip(self._block_tokens, keep.tolist(), strict=True) if k]
        self._held = self._held[keep]
        self._lead = self._lead[keep]
        self._cached0 = self._cached0[keep]

    # ---- prefix cache -----------------------------------------------------------------
    def _caching(self) -> bool:
        return self._n_hashed > 0 or len(self.prefix_cache) > 0

    def _refresh_hits(self) -> None:
        """Waiting rows' hits from the cache as it is now (when it changed since)."""
        cache = self.prefix_cache
        if cache.version == self._seen_version:
            return
        self._seen_version = cache.version
        w = self._w
        for r in np.flatnonzero(w.prefilled == 0).tolist():
            hashes = self._hashes[r]
            if not hashes:
                continue
            lead = cache.leading_hits(hashes)
            self._lead[r] = lead
            w.hit[r] = min(int(lead * self._block_tokens[r] + 1e-9), int(w.prompt[r]) - 1)

    def _release_preempted(self) -> None:
        """Rows the plan preempted give their blocks back (they stay cached, free)."""
        gone = np.flatnonzero((self._held > 0) & (self._w.prefilled == 0))
        for r in gone.tolist():
            self.prefix_cache.release(self._hashes[r][: int(self._held[r])])
            self._held[r] = 0

    def _cache_blocks(self, seg: Segment) -> None:
        """Admitted rows hold their hits; prefilling rows cache what they computed."""
        cache = self.prefix_cache
        if seg.n_admitted:
            for r in seg.rows[-seg.n_admitted :].tolist():
                lead = int(self._lead[r]) if self._hashes[r] else 0
                if self._cached0[r] < 0:
                    self._cached0[r] = int(self._w.hit[r]) if lead else 0
                    cache.count(int(self._prompt0[r]), int(self._cached0[r]))
                if lead:
                    cache.acquire(self._hashes[r][:lead], self._block_tokens[r])
                    self._held[r] = lead
        # blocks are cached as they are computed (whole blocks of the prefilled prompt)
        for r in seg.rows[seg.is_prefill].tolist():
            hashes = self._hashes[r]
            if not hashes:
                continue
            done = min(int(self._w.prefilled[r]), int(self._prompt0[r]))
            full = full_blocks(len(hashes), done, self._block_tokens[r])
            held = int(self._held[r])
            if full > held:
                cache.acquire(hashes[held:full], self._block_tokens[r])
                self._held[r] = full

    def _evict(self) -> None:
        """Free cached blocks fit in the KV cache's free tokens (a block that several
        running requests share is one copy of KV)."""
        w = self._w
        running = w.prefilled > 0
        used = float((w.prefilled[running] + w.decoded[running]).sum())
        used -= self.prefix_cache.shared_tokens
        self.prefix_cache.evict_to(kv_capacity_tokens(self.sched) - used)

    def cached_hashes(self) -> npt.NDArray[np.uint64]:
        """Every block hash the engine's prefix cache holds, sorted."""
        return self.prefix_cache.cached()

    # ---- observation ------------------------------------------------------------------
    @property
    def n_running(self) -> int:
        return int((self._w.prefilled > 0).sum())

    @property
    def n_waiting(self) -> int:
        return int((self._w.prefilled == 0).sum())

    @property
    def n_resident(self) -> int:
        return self._w.n

    def snapshot(self, *, oracle: bool = False) -> InstanceState:
        """Resident requests after the step in flight, in arrival order.

        ``predicted_output_tokens`` are the predictions given at submit (``oracle=True``:
        the real lengths). A preempted request appears as a waiting request whose prompt
        includes the tokens it had generated.
        """
        w = self._w
        if oracle:
            out = w.output.copy()
        else:
            generated_before = self._output0 - w.output  # tokens produced before a preemption
            out = np.maximum(self._predicted - generated_before, 1)
        return InstanceState(w.prompt.copy(), w.prefilled.copy(), w.decoded.copy(), out)

    def resident_ids(self) -> list[str]:
        return list(self._ids)

    def instance_snapshot(self, *, oracle: bool = False) -> InstanceSnapshot:
        """The same state as a wire model (``taken_at`` is the caller's clock)."""
        st = self.snapshot(oracle=oracle)
        residents = [
            ResidentRequest(
                query_id=self._ids[i],
                prompt_tokens=int(st.prompt_tokens[i]),
                prefilled_tokens=int(st.prefilled_tokens[i]),
                decoded_tokens=int(st.decoded_tokens[i]),
                predicted_output_tokens=int(st.predicted_output_tokens[i]),
                arrived_at=float(self._arrival[i]),
            )
            for i in range(st.n)
        ]
        return InstanceSnapshot(
            instance_id=self.instance_id,
            model=self.model,
            taken_at=self._now,
            residents=residents,
            source="sim",
        )

    def step_log(self) -> StepLog:
        """Executed steps (only with ``record_steps=True``)."""
        if not self._log:
            z = np.zeros(0)
            return StepLog(z, z, z, z)
        cols = [np.concatenate([part[i] for part in self._log]) for i in range(4)]
        return StepLog(*cols)
