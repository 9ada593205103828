"""The simulated vLLM engine (``sim.engine.SimEngine``) driven by the wall clock.

Both the ``sim`` worker backend and ``switchyard fake-vllm`` run one of these: requests are
submitted at the current wall-clock time (scaled by ``time_scale``: engine seconds per wall
second) and each subscriber receives a stream of events — first token, further tokens as
the engine decodes them, completion — at the wall-clock times the engine computes. Token
progress between the engine's events is read from its resident state every ``tick_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from schemas import ModelSpec, SchedulerConfig, StepTimeCoefficients

if TYPE_CHECKING:
    from sim.engine import SimEngine, StepLog
    from sim.timing import TimingSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamEvent:
    """What a subscriber sees. ``tokens`` is the total generated so far."""

    kind: Literal["prefill", "tokens", "finished"]
    tokens: int
    prefilled_tokens: int
    wall_s: float  # time.time() when the engine produced it
    cached_tokens: int = 0  # finished: prompt tokens its admission found in the prefix cache


@dataclass
class _Sub:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    queue: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    prefilled: int = 0
    done: bool = False


def make_timing(
    *,
    profile: str | None = None,
    coefficients: StepTimeCoefficients | None = None,
    noise_sigma: float = 0.0,
) -> TimingSource:
    """Step-time source: explicit Eq. 9 coefficients win, else the profile's measured tables."""
    from loaders.profiles import read_profiles
    from routing.steptime import StepTimeModel
    from sim.timing import LinearTiming, TableTiming

    if coefficients is not None:
        return LinearTiming(StepTimeModel.from_coefficients(coefficients), noise_sigma)
    if not profile:
        raise ValueError(
            "a simulated engine needs a step-time profile name or explicit coefficients"
        )
    try:
        return TableTiming.from_profile(read_profiles(), profile, noise_sigma)
    except (KeyError, FileNotFoundError) as exc:
        raise ValueError(
            f"step-time profile {profile!r}: {exc.args[0] if exc.args else exc}"
        ) from None


def timing_for_model(spec: ModelSpec, noise_sigma: float = 0.0) -> TimingSource:
    """The model's explicit ``step_time`` coefficients, else its ``profile``'s tables."""
    if spec.step_time is None and not spec.profile:
        raise ValueError(
            f"model {spec.name!r} has neither step_time coefficients nor a profile: "
            "a simulated engine needs one of them"
        )
    return make_timing(profile=spec.profile, coefficients=spec.step_time, noise_sigma=noise_sigma)


def parse_coefficients(text: str) -> StepTimeCoefficients:
    """``"c0,c1,c2,c3"`` (ms) → coefficients, with an error naming the problem."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 4:
        raise ValueError(f"coefficients must be four numbers c0,c1,c2,c3 (ms), got {text!r}")
    try:
        c = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"coefficients must be numbers, got {text!r}") from None
    return StepTimeCoefficients(
        c0_ms=c[0], c1_ms_per_token=c[1], c2_ms_per_ctx_token=c[2], c3_ms_per_attn_unit=c[3]
    )


class RealtimeEngine:
    """One simulated instance in wall-clock time; use from a single asyncio loop."""

    def __init__(
        self,
        timing: TimingSource,
        sched: SchedulerConfig,
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        tick_s: float = 0.02,
        instance_id: str = "sim-0",
        model: str = "sim",
        record_steps: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        from sim.engine import SimEngine

        if not math.isfinite(time_scale) or time_scale <= 0:
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
        self.time_scale = time_scale
        self.tick_s = tick_s
        self.engine: SimEngine = SimEngine(
            timing,
            sched,
            seed,
            instance_id=instance_id,
            model=model,
            record_steps=record_steps,
            max_model_len=max_model_len,
        )
        self._t0_mono = time.monotonic()
        self._t0_wall = time.time()
        self._subs: dict[str, _Sub] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.failure: BaseException | None = None

    # ---- clocks ----------------------------------------------------------------------
    def vnow(self) -> float:
        return (time.monotonic() - self._t0_mono) * self.time_scale

    def wall_of(self, v_s: float) -> float:
        return self._t0_wall + v_s / self.time_scale

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="realtime-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- requests --------------------------------------------------------------------
    def submit(
        self,
        prompt_tokens: int,
        output_tokens: int,
        predicted_output_tokens: int | None = None,
        request_id: str | None = None,
        prefix_hashes: list[int] | None = None,
        prefix_block_tokens: float = 512.0,
    ) -> AsyncIterator[StreamEvent]:
        """Queue a request now; iterate the returned stream until its ``finished`` event.
        ``prefix_hashes``: its prompt's block hashes for the engine's prefix cache (None: no
        lookup, nothing cached)."""
        if self.failure is not None:
            raise RuntimeError(f"simulated engine stopped: {self.failure!r}")
        rid = request_id or uuid.uuid4().hex
        if rid in self._subs:
            raise ValueError(f"request id {rid!r} is already running on this engine")
        sub = _Sub(rid, prompt_tokens, output_tokens)
        self.engine.submit(rid, self.vnow(), prompt_tokens, output_tokens, predicted_output_tokens,
                           prefix_hashes, prefix_block_tokens)  # fmt: skip
        self._subs[rid] = sub
        self._wake.set()
        return self._stream(sub)

    async def _stream(self, sub: _Sub) -> AsyncIterator[StreamEvent]:
        try:
            while True:
                if self.failure is not None and sub.queue.empty():
                    raise RuntimeError(f"simulated engine stopped: {self.failure!r}")
                ev = await sub.queue.get()
                yield ev
                if ev.kind == "finished":
                    return
        finally:
            sub.done = True  # a client that goes away stops receiving; the engine finishes the work

    @property
    def n_running(self) -> int:
        return self.engine.n_running

    @property
    def n_waiting(self) -> int:
        return self.engine.n_waiting

    def kv_usage(self) -> float:
        """Fraction of the KV cache (``kv_blocks`` x ``block_size_tokens``) holding tokens."""
        st = self.engine.snapshot()
        sched = self.engine.sched
        capacity = sched.kv_blocks * sched.block_size_tokens
        if not st.n or capacity <= 0:
            return 0.0
        used = float((st.prefilled_tokens + st.decoded_tokens).sum())
        return min(1.0, used / capacity)

    def drain_step_log(self) -> StepLog:
        """Steps executed since the last drain (needs ``record_steps=True``)."""
        steps = self.engine.step_log()
        # SimEngine keeps its log for a whole run; a long-lived server must not grow it forever
        log_list = getattr(self.engine, "_log", None)
        if isinstance(log_list, list):
            log_list.clear()
        return steps

    # ---- the loop --------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                now_v = self.vnow()
                for ev in self.engine.advance_to(now_v):
                    self._on_event(ev.kind, ev.request_id, ev.t_s, ev.cached_tokens)
                self._progress(now_v)
                nxt = self.engine.next_event_s()
                if nxt is None and not self._subs:
                    await self._wake.wait()
                    continue
                delay = self.tick_s if nxt is None else (nxt - self.vnow()) / self.time_scale
                if any(s.emitted > 0 for s in self._subs.values()):
                    delay = min(delay, self.tick_s)  # stream decode progress between events
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(delay, 0.0005))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in the engine must reach every waiting client
            log.exception("simulated engine failed")
            self.failure = exc
            for sub in self._subs.values():
                sub.queue.put_nowait(
                    StreamEvent("finished", sub.emitted, sub.prefilled, time.time())
                )
            self._subs.clear()

    def _on_event(self, kind: str, rid: str, t_v: float, cached_tokens: int = 0) -> None:
        sub = self._subs.get(rid)
        if sub is None:
            return
        wall = self.wall_of(t_v)
        if kind == "first_token" and sub.emitted == 0:
            sub.emitted = 1
            sub.prefilled = sub.prompt_tokens
            sub.queue.put_nowait(StreamEvent("tokens", 1, sub.prefilled, wall))
        elif kind == "finished":
            sub.prefilled = sub.prompt_tokens
            sub.emitted = sub.output_tokens
            sub.queue.put_nowait(
                StreamEvent("finished", sub.output_tokens, sub.prefilled, wall, cached_tokens)
            )
            del self._subs[rid]

    def _progress(self, now_v: float) -> None:
        """Emit prefill progress and decoded tokens the engine has produced by ``now_v``."""
        if not self._subs:
            return
        st = self.engine.snapshot(oracle=True)
        in_flight = self.engine.busy_until_s() > now_v + 1e-12
        wall = self.wall_of(now_v)
        for i, rid in enumerate(self.engine.resident_ids()):
            sub = self._subs.get(rid)
            if sub is None:
                continue
            prefilled = int(st.prefilled_tokens[i])
            if sub.emitted == 0:
                # (may lead the clock by the one step in flight: the engine applies it early)
                if 0 < prefilled < sub.prompt_tokens and prefilled > sub.prefilled:
                    sub.prefilled = prefilled
                    sub.queue.put_nowait(StreamEvent("prefill", 0, prefilled, wall))
                continue
            # a decode step in flight adds one token the clock has not reached yet
            visible = int(st.decoded_tokens[i]) - (1 if in_flight else 0)
            visible = min(visible, sub.output_tokens - 1)  # the last token comes with "finished"
            if visible > sub.emitted:
                sub.emitted = visible
                sub.queue.put_nowait(StreamEvent("tokens", visible, sub.prompt_tokens, wall))
