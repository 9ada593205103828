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

from routing.scheduling import Segment, Workload, kv_capacity_tokens
from routing.types import InstanceState
from schemas import InstanceSnapshot, ResidentRequest, SchedulerConfig
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
    ) -> None:
        """Queue a request arriving at ``arrival_s`` (must not be before the engine's clock)."""
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
            seg = self._w.plan()
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
                )
            )
            self._pending.append(EngineEvent("finished", self._ids[r], t_end))
        self._w.remove(rows)
        keep = np.ones(len(self._ids), dtype=bool)
        keep[rows] = False
        self._ids = [i for i, k in zip(self._ids, keep.tolist(), strict=True) if k]
        self._arrival = self._arrival[keep]
        self._first = self._first[keep]
        self._predicted = self._predicted[keep]
        self._prompt0 = self._prompt0[keep]
        self._output0 = self._output0[keep]

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
