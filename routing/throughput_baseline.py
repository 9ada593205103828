"""Paper A's strawman TTFT estimator: queued prefill tokens / measured throughput.

    TTFT = (sum over residents of unprefilled prompt tokens + the new prompt) / throughput

It ignores decode interference and batching, which is why paper A reports 85% MAPE for it.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def prefill_tokens_per_s(model: StepTimeModel, sched: SchedulerConfig) -> float:
    """Prefill throughput of full-budget chunks on an otherwise idle instance."""
    budget = sched.chunk_size_tokens if sched.policy == "sarathi" else sched.max_num_batched_tokens
    ms = float(model.prefill_ms(budget))
    return budget / ms * 1000.0


def throughput_ttft_ms(
    state: InstanceState, prompt_tokens: IntArray, tokens_per_s: float
) -> FloatArray:
    """TTFT (ms) of each query appended alone, by the throughput rule."""
    if not np.isfinite(tokens_per_s) or tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be a finite number > 0, got {tokens_per_s}")
    queued = float(np.maximum(state.prompt_tokens - state.prefilled_tokens, 0).sum())
    p = np.asarray(prompt_tokens, dtype=np.float64)
    return np.asarray((queued + p) / tokens_per_s * 1000.0, dtype=np.float64)
