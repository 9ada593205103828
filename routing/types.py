"""The decision core's own types: what a ``Router`` sees and returns.

Routers never fetch: the service (Redis) and the simulator (virtual engines) both
hand them ``InstanceView`` objects built from live state, and a ``Budget``.
Arrays, not pydantic models, so a window of hundreds of queries over dozens of
instances costs microseconds to describe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from routing.steptime import StepTimeModel
from schemas import Decision, InstanceSnapshot, Query

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class InstanceState:
    """Resident requests of one instance, one row each, in arrival (FCFS) order.

    A waiting request has ``prefilled == 0``; a decoding one has ``prefilled == prompt``.
    """

    prompt_tokens: IntArray
    prefilled_tokens: IntArray
    decoded_tokens: IntArray
    predicted_output_tokens: IntArray

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        for name in ("prefilled_tokens", "decoded_tokens", "predicted_output_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"InstanceState.{name} has {len(getattr(self, name))} rows, expected {n}")
        if n:
            if (self.prompt_tokens < 0).any() or (self.prefilled_tokens < 0).any() or (self.decoded_tokens < 0).any():
                raise ValueError("InstanceState: token counts must be >= 0")
            bad = np.flatnonzero(self.prefilled_tokens > self.prompt_tokens)
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"InstanceState row {i}: prefilled_tokens ({int(self.prefilled_tokens[i])}) "
                    f"must be <= prompt_tokens ({int(self.prompt_tokens[i])})"
                )

    @property
    def n(self) -> int:
        return len(self.prompt_tokens)

    @classmethod
    def empty(cls) -> InstanceState:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z)

    @classmethod
    def from_snapshot(cls, snap: InstanceSnapshot) -> InstanceState:
        rs = snap.residents
        return cls(
            np.fromiter((r.prompt_tokens for r in rs), np.int64, len(rs)),
            np.fromiter((r.prefilled_tokens for r in rs), np.int64, len(rs)),
            np.fromiter((r.decoded_tokens for r in rs), np.int64, len(rs)),
            np.fromiter((r.predicted_output_tokens for r in rs), np.int64, len(rs)),
        )


@dataclass(frozen=True)
class RecentFinished:
    """Requests that left an instance recently, one row each: what they took of the engine
    while the residents waited (``routing.sfs.catch_up`` replays them with the residents).

    ``arrived_ms``: how long before now each reached the engine; ``finished_ms``: how long
    before now it left (its last token); ``output_tokens``: tokens it produced (>= 1).
    """

    prompt_tokens: IntArray
    output_tokens: IntArray
    arrived_ms: FloatArray
    finished_ms: FloatArray

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        for name in ("output_tokens", "arrived_ms", "finished_ms"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RecentFinished.{name} has {len(getattr(self, name))} rows, expected {n}")
        if n:
            if (self.prompt_tokens < 0).any() or (self.output_tokens < 1).any():
                raise ValueError("RecentFinished: prompt_tokens must be >= 0 and output_tokens >= 1")
            if not (np.isfinite(self.arrived_ms).all() and np.isfinite(self.finished_ms).all()):
                raise ValueError("RecentFinished: arrived_ms and finished_ms must be finite")
            bad = np.flatnonzero(self.finished_ms > self.arrived_ms)
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"RecentFinished row {i}: it left {float(self.finished_ms[i]):.1f} ms ago, "
                    f"before it arrived ({float(self.arrived_ms[i]):.1f} ms ago)"
                )

    @property
    def n(self) -> int:
        return len(self.prompt_tokens)

    @classmethod
    def of(
        cls, rows: Sequence[tuple[int, int, float, float]] | npt.NDArray[np.float64]
    ) -> RecentFinished:
        """From rows ``(prompt, output, arrived_ms, finished_ms)``."""
        a = np.asarray(rows, dtype=np.float64).reshape(-1, 4)
        return cls(
            a[:, 0].astype(np.int64), a[:, 1].astype(np.int64), a[:, 2].copy(), a[:, 3].copy()
        )


@dataclass(frozen=True)
class InstanceView:
    """What a router knows about one instance at decision time.

    ``state`` is None when there is no trustworthy live state (cloud endpoint, stale or
    missing snapshot): routers then use the LPS average case and flag the decision.
    ``prefix_hashes``: what its prefix cache holds (the router's model of it), for hits.
    ``step_time``: the model's Eq. 9 coefficients as the workers refit them online
    (``routing.recalibration``, read from Redis with the snapshot); None: the configured ones.
    ``dispatch_ms``: the delay from a decision to the engine receiving the query (the route
    topic, the worker's poll), as its workers measure it; added to every predicted TTFT,
    which counts from decision time (with the server's own time per request outside engine
    steps, which the same workers measure and publish with it).
    ``waited_ms``: per row of ``state``, how long that resident has been at the engine at
    decision time (from its ``arrived_at``; 0 where unknown); None: not known.
    ``finished``: requests that left the instance recently (the snapshot's ``finished``),
    timed from decision time; None: none known.
    """

    instance_id: str
    model: str
    state: InstanceState | None
    free_slots: int
    age_s: float = 0.0
    arrival_rate_per_s: float = 0.0  # recent arrivals, for the LPS average case
    stale: bool = False
    # prefix block hashes the instance's cache holds, sorted (routing.prefix); None: unknown
    prefix_hashes: npt.NDArray[np.uint64] | None = None
    step_time: StepTimeModel | None = None
    dispatch_ms: float = 0.0
    waited_ms: npt.NDArray[np.float64] | None = None
    finished: RecentFinished | None = None


@dataclass(frozen=True)
class Budget:
    """Money a window may spend: the window budget and each tenant's remaining budget."""

    window_usd: float
    tenant_remaining_usd: Mapping[str, float] = field(default_factory=dict)
    allow_overspend: bool = False

    def __post_init__(self) -> None:
        if not np.isfinite(self.window_usd) or self.window_usd < 0:
            raise ValueError(f"Budget.window_usd must be a finite number >= 0, got {self.window_usd}")
        for tenant, usd in self.tenant_remaining_usd.items():
            if not np.isfinite(usd) or usd < 0:
                raise ValueError(f"Budget for tenant {tenant!r} must be a finite number >= 0, got {usd}")


@runtime_checkable
class Router(Protocol):
    """One routing policy. Pure: same inputs, same decisions."""

    name: str

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        """One decision per query, in the order of ``queries``."""
        ...
