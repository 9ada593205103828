"""LPS average case: TTFT without live state (paper A, "Average-case model"; DESIGN.md, "LPS").

An instance is a Limited Processor Sharing queue: at most ``k = max_concurrency`` queries
are served together (continuous batching); the rest wait FIFO. As a birth-death chain with
arrival rate ``lam`` and state-dependent completion rate ``mu(n)``::

    p_n = p_0 * prod_{i=1..n} lam / mu(min(i, k))
    L_q = sum_{n>k} (n - k) p_n = p_k * rho / (1 - rho)^2,   rho = lam / mu(k)
    W_q = L_q / lam                                            (Little's law)

``mu(n)`` comes from the step-time model (Eq. 9): with ``n`` requests of mean prompt ``P``
and output ``n_out`` in the batch, each needs ``n_out`` decode steps of
``t_dec(n) = c0 + c1*n + c2*n*(P + n_out/2)`` and its prefill adds ``c1*P + c3*P^2/2`` to the
steps it shares, so ``n`` completions take ``n_out*t_dec(n) + n*(c1*P + c3*P^2/2)``::

    mu(n) = n / (n_out * t_dec(n) + n * (c1*P + c3*P^2/2))

TTFT = W_q + the residual of the step in flight (half a decode step) + the query's own
prefill, batched with the mean number of running decodes.
"""

from __future__ import annotations

import math

import numpy as np

from routing.steptime import StepTimeModel
from schemas import SchedulerConfig


def _service(model: StepTimeModel, n: np.ndarray, P: float, n_out: float) -> np.ndarray:
    t_dec = (
        model.c0_ms + model.c1_ms_per_token * n + model.c2_ms_per_ctx_token * n * (P + n_out / 2.0)
    )
    prefill = model.c1_ms_per_token * P + model.c3_ms_per_attn_unit * P * P / 2.0
    return np.asarray(n / (n_out * t_dec + n * prefill), dtype=np.float64)  # completions per ms


def lps_distribution(
    arrival_rate_per_s: float,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    max_concurrency: int,
    model: StepTimeModel,
) -> tuple[np.ndarray, float, float]:
    """``(p_0..p_k, rho, mean queue length)`` of the chain; rho >= 1 means unstable."""
    lam = arrival_rate_per_s / 1000.0  # per ms
    k = int(max_concurrency)
    n = np.arange(1, k + 1, dtype=np.float64)
    mu = _service(model, n, mean_prompt_tokens, mean_output_tokens)
    rho = lam / float(mu[-1])
    if rho >= 1.0:
        return np.zeros(k + 1), rho, math.inf
    # log-space products for numerical safety at large k
    logp = np.concatenate([[0.0], np.cumsum(np.log(lam / mu))]) if lam > 0 else None
    if logp is None:
        p = np.zeros(k + 1)
        p[0] = 1.0
        return p, 0.0, 0.0
    logp -= logp.max()
    w = np.exp(logp)
    tail = w[-1] * rho / (1.0 - rho)  # sum_{n>k} p_n (unnormalised)
    z = w.sum() + tail
    p = w / z
    lq = p[-1] * rho / (1.0 - rho) ** 2
    return p, rho, float(lq)


def lps_ttft_ms(
    arrival_rate_per_s: float,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    max_concurrency: int,
    model: StepTimeModel,
    sched: SchedulerConfig,
) -> float:
    """Mean TTFT (ms) of a query at an instance seen only through its arrival rate.

    Returns ``inf`` when the arrival rate reaches the instance's capacity.
    """
    if not math.isfinite(arrival_rate_per_s) or arrival_rate_per_s < 0:
        raise ValueError(
            f"arrival_rate_per_s must be a finite number >= 0, got {arrival_rate_per_s}"
        )
    if mean_prompt_tokens < 0 or not math.isfinite(mean_prompt_tokens):
        raise ValueError(
            f"mean_prompt_tokens must be a finite number >= 0, got {mean_prompt_tokens}"
        )
    if mean_output_tokens < 1 or not math.isfinite(mean_output_tokens):
        raise ValueError(
            f"mean_output_tokens must be a finite number >= 1, got {mean_output_tokens}"
        )
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    k = min(int(max_concurrency), sched.max_num_seqs)
    # the KV cache bounds concurrency too: each request holds about P + O tokens at the end
    kv_seqs = (
        sched.kv_blocks
        * sched.block_size_tokens
        // max(int(mean_prompt_tokens + mean_output_tokens), 1)
    )
    k = max(1, min(k, int(kv_seqs)))
    P = max(float(mean_prompt_tokens), 1.0)
    n_out = float(mean_output_tokens)
    p, rho, lq = lps_distribution(arrival_rate_per_s, P, n_out, k, model)
    if not math.isfinite(lq):
        return math.inf
    lam = arrival_rate_per_s / 1000.0
    wq = lq / lam if lam > 0 else 0.0
    # mean number in service (what a new prefill is batched with)
    n_busy = float((np.arange(k + 1) * p).sum() + k * (1.0 - p.sum()))
    decode_ctx = n_busy * (P + n_out / 2.0)
    t_dec = model.c0_ms + model.c1_ms_per_token * n_busy + model.c2_ms_per_ctx_token * decode_ctx
    budget = sched.chunk_size_tokens if sched.policy == "sarathi" else sched.max_num_batched_tokens
    per_step = max(budget - n_busy, 1.0) if sched.policy != "vllm-v0" else max(budget, P)
    steps = math.ceil(P / per_step)
    prefill = steps * t_dec + model.c1_ms_per_token * P + model.c3_ms_per_attn_unit * P * P / 2.0
    residual = 0.5 * t_dec if n_busy > 0 else 0.0
    return float(wq + residual + prefill)
