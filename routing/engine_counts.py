"""The engine's own counts reconciled with the resident list its worker keeps (issue 18).

A worker lists the requests it sent its engine (``InstanceState``, one row each); the engine
says in its ``/metrics`` how many it runs and how many wait (vLLM
``num_requests_running``/``_waiting``). The list misses requests that reached the engine
some other way (another client of the same server, a worker restarted with its list lost),
so the router's view holds at least as many of each as the engine reports:

    running_view = max(running_listed, engine_running)    running: prefilled > 0
    waiting_view = max(waiting_listed, engine_waiting)    waiting: prefilled == 0

Missing rows are added after the listed ones as typical requests: the listed rows' mean
prompt (else ``default_prompt_tokens``) and mean predicted output (else
``default_output_tokens``); a running one fully prefilled with one token decoded, a waiting
one with nothing done. Listed rows are never dropped (the engine reporting fewer means its
scrape is older than the list, or listed requests still queue in the worker). Unknown
counts (None) change nothing. Pure: the worker scrapes, ``streams.views`` calls this.

The engine's KV-cache usage (vLLM ``kv_cache_usage_perc``, 0..1) sizes the added running
rows when it is known: the tokens it holds beyond what the listed rows hold are split
evenly over them, so an unlisted long-context request costs the router its real share of
KV blocks and decode time, not a typical prompt's:

    prompt_added_running = clip((kv_usage * kv_capacity_tokens - listed_tokens) / add_running,
                                1, max_model_len)

(``listed_tokens`` = the listed rows' prefilled + decoded tokens). With no added running row
the usage changes nothing: the engine's blocks are then the listed requests', shared prefix
blocks counted once, so it can be below the listed sum but says nothing new.
"""

from __future__ import annotations

import numpy as np

from routing.types import InstanceState

DEFAULT_PROMPT_TOKENS = 512


def reconcile_engine_counts(
    state: InstanceState,
    engine_running: int | None,
    engine_waiting: int | None,
    default_prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    default_output_tokens: int = 128,
    engine_kv_usage: float | None = None,
    kv_capacity_tokens: int | None = None,
    max_model_len: int | None = None,
) -> InstanceState:
    """``state`` with rows added until it has the engine's running and waiting counts."""
    running_listed = int((state.prefilled_tokens > 0).sum())
    add_running = max(0, (engine_running or 0) - running_listed)
    add_waiting = max(0, (engine_waiting or 0) - (state.n - running_listed))
    if add_running + add_waiting == 0:
        return state
    prompt = int(round(state.prompt_tokens.mean())) if state.n else default_prompt_tokens
    output = int(round(state.predicted_output_tokens.mean())) if state.n else default_output_tokens
    prompt, output = max(1, prompt), max(1, output)
    running_prompt = prompt
    if add_running and engine_kv_usage is not None and kv_capacity_tokens:
        listed = int(state.prefilled_tokens.sum() + state.decoded_tokens.sum())
        unlisted = engine_kv_usage * kv_capacity_tokens - listed
        running_prompt = max(1, int(round(unlisted / add_running)))
        if max_model_len is not None:
            running_prompt = min(running_prompt, max_model_len)
    k = add_running + add_waiting
    running = np.arange(k) < add_running
    prompts = np.where(running, running_prompt, prompt).astype(np.int64)
    return InstanceState(
        np.concatenate([state.prompt_tokens, prompts]),
        np.concatenate([state.prefilled_tokens, np.where(running, prompts, 0).astype(np.int64)]),
        np.concatenate([state.decoded_tokens, running.astype(np.int64)]),
        np.concatenate([state.predicted_output_tokens, np.full(k, output, np.int64)]),
    )
