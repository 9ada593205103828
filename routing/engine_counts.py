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
    k = add_running + add_waiting
    running = np.arange(k) < add_running
    return InstanceState(
        np.concatenate([state.prompt_tokens, np.full(k, prompt, np.int64)]),
        np.concatenate([state.prefilled_tokens, np.where(running, prompt, 0).astype(np.int64)]),
        np.concatenate([state.decoded_tokens, running.astype(np.int64)]),
        np.concatenate([state.predicted_output_tokens, np.full(k, output, np.int64)]),
    )
