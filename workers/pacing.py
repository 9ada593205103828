"""Admission pacing for an endpoint with a request rate limit (``ModelSpec.rate_limit_rps``).

The rule is the simulator's for a cloud endpoint (``sim.cluster.CloudEndpoint``): a request
is admitted at ``start = max(now, next)`` and moves ``next`` to ``start + 1 / rate``, so
admissions are at least ``1 / rate`` apart and a quiet spell saves no burst. The worker
applies it before a request waits for a concurrency slot, as the simulator does; an
endpoint that still answers 429 is retried by the backend (``workers.backends.vllm``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable


class AdmissionPacer:
    """At most ``rate_per_s`` admissions a second, evenly spaced."""

    def __init__(
        self,
        rate_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not math.isfinite(rate_per_s) or rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be a finite number > 0, got {rate_per_s}")
        self.interval_s = 1.0 / rate_per_s
        self._clock = clock
        self._sleep = sleep
        self._next_s = -math.inf

    def reserve(self) -> float:
        """Take the next admission; the seconds to wait for it. No await: concurrent
        callers each get their own turn."""
        now = self._clock()
        start = max(now, self._next_s)
        self._next_s = start + self.interval_s
        return start - now

    async def wait(self) -> float:
        """Wait for this request's turn; the seconds waited."""
        delay = self.reserve()
        if delay > 0:
            await self._sleep(delay)
        return delay
