"""Reconciling the router's prefix-cache model of an instance with the engine's own count
(issue 14): vLLM's ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
(prompt tokens looked up / found cached, counters summed over label sets).

The worker feeds :class:`PrefixReconciler` each scrape of ``/metrics`` and the hit tokens the
model predicted for the requests it served since; when enough evidence has gathered, it
returns the model's new capacity (``schemas.prefix.reconciled_capacity``: the same rule the
simulator applies), which the worker writes with its next touch (``state.prefix``: ``PrefixTouch.set_capacity``).
The worker (``workers.worker``) scrapes with each heartbeat (``EngineLoad.prefix_counters``)
and feeds ``served`` as each request starts (the router's ``Decision.predicted_cached_tokens``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas.prefix import reconciled_capacity

_LINE = re.compile(r"^(vllm:prefix_cache_(?:queries|hits)_total)(?:\{[^}]*\})?\s+(\S+)")


def parse_prefix_counters(text: str) -> tuple[float, float] | None:
    """``(queried tokens, hit tokens)`` from vLLM's Prometheus text; None when absent."""
    got: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        try:
            v = float(m.group(2))
        except ValueError:
            continue
        got[m.group(1)] = got.get(m.group(1), 0.0) + v
    if "vllm:prefix_cache_queries_total" not in got:
        return None
    return got["vllm:prefix_cache_queries_total"], got.get("vllm:prefix_cache_hits_total", 0.0)


@dataclass
class PrefixReconciler:
    """Counter deltas against the model's predictions, for one instance."""

    capacity_tokens: float
    max_tokens: float
    _last: tuple[float, float] | None = None
    _predicted: float = 0.0
    _engine: float = 0.0
    engine_hit_rate: float | None = field(default=None)  # over everything seen so far

    def served(self, predicted_hit_tokens: float) -> None:
        """The model predicted this many cached tokens for a request the engine took."""
        self._predicted += max(0.0, predicted_hit_tokens)

    def scrape(self, counters: tuple[float, float] | None) -> float | None:
        """Take one scrape; the new capacity when it changed, else None. A counter that went
        down (the engine restarted) starts the count again."""
        if counters is None:
            return None
        queries, hits = counters
        if queries > 0:
            self.engine_hit_rate = hits / queries
        last, self._last = self._last, counters
        if last is None or queries < last[0] or hits < last[1]:
            self._predicted = self._engine = 0.0
            return None
        self._engine += hits - last[1]
        new = reconciled_capacity(self.capacity_tokens, self.max_tokens, self._predicted, self._engine)
        if new == self.capacity_tokens:
            return None
        self.capacity_tokens = new
        self._predicted = self._engine = 0.0
        return new
