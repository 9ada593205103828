"""What a worker observes, turned into online refit rows of Eq. 9 (``routing.recalibration``).

The worker calls :meth:`StepTimeFeed.sent` when it hands a request to the engine,
:meth:`StepTimeFeed.progress` on every streamed chunk (before any throttling) and
:meth:`StepTimeFeed.finished` when the request is over; every ``refit_s`` it calls
:meth:`StepTimeFeed.refit` and publishes the result (``state.StateStore.step_time_publish``).

Rows (see ``routing.recalibration`` for the approximations):

* a **TTFT row** per request: the worker's in-flight requests when it was sent (prompt,
  tokens streamed so far, the router's predicted output length; a request still waiting for
  its first token counts as not prefilled at all — the stream says nothing of prefill
  progress) plus the new prompt, against the engine-side TTFT (sent → first token);
* a **decode row** each ``decode_row_tokens`` tokens of the oldest in-flight request while
  every in-flight request is decoding and none was sent, got its first token or finished.

A row measured under ``min_step_ms`` per step is dropped (stream chunks that reached the
worker late and together look like many tokens in no time). Rows are only taken while the
engine's own count of requests (``/metrics``: running +
waiting, from the heartbeat) is at most one above the worker's: an engine that other
clients share runs batches the worker cannot see.

The server's own time per request outside engine steps (API process, IPC to the engine core,
detokenising, streaming) is measured on requests alone on the engine from their send to their
first token (nothing in flight when sent, nothing sent before the first token came): their
engine-side TTFT minus the current model's Eq. 9 prefill; the median of the recent ones
(:meth:`StepTimeFeed.server_ms`) is published with the dispatch delay, in the same field
(:meth:`StepTimeFeed.dispatch_ms`), since the router adds both to every TTFT it predicts.
The dispatch delay is the path from the router's decision to the engine less the time the
request waited for one of the worker's concurrency slots: that wait is load, which the router
already prices (the queued request is a resident of the instance's snapshot), not transport;
counting it here too would add the queue twice once an instance saturates.

Two live errors are kept over the last ``error_window`` requests: ``router``, the SFS TTFT
the router predicted at decision time (``Decision.predicted_ttft_ms``) against the TTFT
measured from the same moment (first token − ``decided_at``), and ``refit``, the current
coefficients' SFS estimate of each TTFT row against the engine-side TTFT.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from routing.recalibration import OnlineRefit, RefitConfig, RefitResult, decode_row, ttft_row
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig


@dataclass(frozen=True)
class StepTimeFeedConfig:
    refit: RefitConfig = RefitConfig()
    decode_row_tokens: int = 8  # tokens of the oldest request per decode row
    error_window: int = 200  # recent requests the live TTFT errors average over
    foreign_tolerance: int = 1  # engine requests beyond the worker's own before rows stop
    # a row measured under this per step is not a measurement: chunks that reached the worker
    # late and together (its event loop stalled) look like many tokens in no time
    min_step_ms: float = 0.5
    # dispatch delays over this are not a path the router can predict (a query re-delivered
    # after a worker restart, or decided under a skewed clock): they are not kept
    max_dispatch_ms: float = 60_000.0

    def __post_init__(self) -> None:
        if self.decode_row_tokens < 1:
            raise ValueError(
                f"StepTimeFeedConfig.decode_row_tokens must be >= 1, got {self.decode_row_tokens}"
            )
        if self.error_window < 1:
            raise ValueError(
                f"StepTimeFeedConfig.error_window must be >= 1, got {self.error_window}"
            )


@dataclass
class _InFlight:
    order: int
    prompt_tokens: int
    predicted_output_tokens: int
    sent_at: float
    state: InstanceState  # the other in-flight requests when it was sent
    decoded: int = 0
    first_at: float | None = None
    predicted_ttft_ms: float | None = None  # the router's, from decided_at
    decided_at: float | None = None
    lone: bool = False  # alone on the engine from its send to its first token


@dataclass
class _Anchor:
    qid: str
    epoch: int
    at: float
    decoded: int
    contexts: list[int] = field(default_factory=list)


class StepTimeFeed:
    """Observations of one worker's engine → rows → an ``OnlineRefit`` of its model."""

    def __init__(
        self,
        prior: StepTimeModel,
        sched: SchedulerConfig,
        config: StepTimeFeedConfig = StepTimeFeedConfig(),
    ) -> None:
        self.sched = sched
        self.config = config
        self.refitter = OnlineRefit(prior, config.refit)
        self._live: dict[str, _InFlight] = {}
        self._order = 0
        self._epoch = 0  # bumped whenever the batch composition changes phase
        self._anchor: _Anchor | None = None
        self._foreign = False  # the engine runs requests that are not this worker's
        self.rows = {"ttft": 0, "decode": 0, "skipped": 0}
        self._err_router: deque[float] = deque(maxlen=config.error_window)
        self._err_refit: deque[float] = deque(maxlen=config.error_window)
        self._dispatch_ms: deque[float] = deque(maxlen=config.error_window)
        self._server_ms: deque[float] = deque(maxlen=config.error_window)
        self.last: RefitResult | None = None

    @property
    def model(self) -> StepTimeModel:
        return self.refitter.model

    # ---- what the worker sees -------------------------------------------------------
    def state(self) -> InstanceState:
        """The in-flight requests as SFS takes them (a snapshot of what the worker knows)."""
        rs = sorted(self._live.values(), key=lambda r: r.order)
        prompt = np.fromiter((r.prompt_tokens for r in rs), np.int64, len(rs))
        decoded = np.fromiter((r.decoded for r in rs), np.int64, len(rs))
        prefilled = np.where(decoded > 0, prompt, 0)
        predicted = np.fromiter(
            (max(r.predicted_output_tokens, r.decoded + 1) for r in rs), np.int64, len(rs)
        )
        return InstanceState(prompt, prefilled.astype(np.int64), decoded, predicted)

    def sent(
        self,
        qid: str,
        prompt_tokens: int,
        predicted_output_tokens: int,
        now: float,
        *,
        predicted_ttft_ms: float | None = None,
        decided_at: float | None = None,
        slot_wait_s: float = 0.0,
    ) -> None:
        """The request is handed to the engine now (``decided_at``: the router's decision,
        on the same clock as ``now``; ``slot_wait_s``: how long it waited here for one of the
        worker's concurrency slots, which is left out of the dispatch delay)."""
        if decided_at is not None:
            delay_ms = (now - decided_at - max(0.0, slot_wait_s)) * 1000.0
            if math.isfinite(delay_ms) and 0.0 <= delay_ms <= self.config.max_dispatch_ms:
                self._dispatch_ms.append(delay_ms)
        self._order += 1
        for other in self._live.values():  # a prefill it may now share a step with
            if other.first_at is None:
                other.lone = False
        self._live[qid] = _InFlight(
            self._order,
            max(1, int(prompt_tokens)),
            max(1, int(predicted_output_tokens)),
            now,
            self.state(),
            predicted_ttft_ms=predicted_ttft_ms,
            decided_at=decided_at,
            lone=not self._live,
        )
        self._epoch += 1

    def progress(self, qid: str, decoded: int, now: float) -> None:
        """A streamed chunk: ``decoded`` tokens so far."""
        r = self._live.get(qid)
        if r is None or decoded <= r.decoded:
            return
        if r.decoded == 0:
            r.first_at = now
            self._epoch += 1
        r.decoded = int(decoded)
        oldest = min(self._live, key=lambda k: self._live[k].order)
        if qid != oldest:
            return
        a = self._anchor
        if a is not None and a.qid == qid and a.epoch == self._epoch:
            k = r.decoded - a.decoded
            if k < self.config.decode_row_tokens:
                return
            self._add(decode_row(a.contexts, k), (now - a.at) * 1000.0, "decode")
        self._anchor = None
        if all(x.decoded > 0 for x in self._live.values()):
            contexts = [x.prompt_tokens + x.decoded for x in self._live.values()]
            self._anchor = _Anchor(qid, self._epoch, now, r.decoded, contexts)

    def finished(
        self,
        qid: str,
        engine_ttft_ms: float | None,
        first_token_at: float | None,
        prompt_tokens: int | None = None,
    ) -> None:
        """The request is over (``engine_ttft_ms`` None: it failed before its first token).
        ``prompt_tokens``: the engine's own count (usage), when it said, for this row."""
        r = self._live.pop(qid, None)
        if r is None:
            return
        self._epoch += 1
        if engine_ttft_ms is None or first_token_at is None:
            return
        if r.lone and not self._foreign:  # a lone request: its TTFT is one prefill
            lone = float(self.model.prefill_ms(prompt_tokens or r.prompt_tokens))
            if (
                math.isfinite(engine_ttft_ms)
                and 0.0 < engine_ttft_ms <= self.config.max_dispatch_ms
            ):
                self._server_ms.append(engine_ttft_ms - lone)
        if r.predicted_ttft_ms is not None and r.decided_at is not None:
            measured = (first_token_at - r.decided_at) * 1000.0
            if measured > 0:
                self._err_router.append(abs(r.predicted_ttft_ms - measured) / measured)
        try:
            row = ttft_row(r.state, prompt_tokens or r.prompt_tokens, self.sched)
        except ValueError:
            self.rows["skipped"] += 1
            return
        if engine_ttft_ms > 0:
            self._err_refit.append(
                abs(float(row @ self.model.coef) - engine_ttft_ms) / engine_ttft_ms
            )
        self._add(row, engine_ttft_ms, "ttft")

    def engine_counts(self, running: int | None, waiting: int | None) -> None:
        """The engine's own counts (heartbeat): more than ours means other clients share it."""
        if running is None:
            self._foreign = False
            return
        theirs = running + (waiting or 0)
        self._foreign = theirs > len(self._live) + self.config.foreign_tolerance

    def _add(self, row: np.ndarray, t_ms: float, kind: str) -> None:
        implausible = t_ms < self.config.min_step_ms * float(row[0])
        if self._foreign or implausible or not self.refitter.add(row, t_ms):
            self.rows["skipped"] += 1
            return
        self.rows[kind] += 1

    # ---- results --------------------------------------------------------------------
    def refit(self) -> RefitResult:
        self.last = self.refitter.refit()
        return self.last

    def dispatch_ms(self) -> float | None:
        """The delay to add to the router's TTFT predictions: the dispatch delay plus the
        server's own time per request (never below 0; None: no sample of either yet)."""
        d = dispatch_estimate_ms(self._dispatch_ms)
        s = self.server_ms()
        if d is None and s is None:
            return None
        return max(0.0, (d or 0.0) + (s or 0.0))

    def server_ms(self) -> float | None:
        """The median of recent lone requests' TTFT minus their Eq. 9 prefill (None: none yet)."""
        return dispatch_estimate_ms(self._server_ms)

    def ttft_error(self, source: str) -> float | None:
        """Mean relative TTFT error of recent requests: ``router`` or ``refit``."""
        errs = self._err_router if source == "router" else self._err_refit
        if not errs:
            return None
        value = float(np.mean(errs))
        return value if math.isfinite(value) else None


def dispatch_estimate_ms(samples_ms: Iterable[float]) -> float | None:
    """The median of the recent dispatch delays (ms), None without a finite sample.

    The median, not the mean: a few queries re-delivered after a rebalance or held behind a
    stalled poll would otherwise add their seconds to every prediction."""
    a = np.fromiter(samples_ms, np.float64)
    a = a[np.isfinite(a)]
    return float(np.median(a)) if a.size else None
