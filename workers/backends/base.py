"""What a worker asks of an inference backend, and what it gets back.

A backend turns one routed query into one ``Generation``: text, token counts and wall-clock
times. Engine failures never raise: they come back as ``Generation.error`` so the worker
always publishes a Result. Token progress is reported through ``on_progress`` as it happens
(the worker throttles it into Redis resident-state updates).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from schemas import Query

ProgressFn = Callable[[int, int], None]  # (prefilled_tokens, decoded_tokens)
TextFn = Callable[[str], None]  # a piece of output text, as the engine streams it


@dataclass(frozen=True)
class GenerationRequest:
    query: Query
    request_id: str  # unique per attempt (a re-delivered query gets a new one)
    prompt_tokens: int  # the producer's count, else an estimate
    predicted_output_tokens: int
    on_text: TextFn | None = None  # set when the text is relayed while it streams
    # the output cap to send when the query sets none (ModelSpec.output_cap_tokens: the
    # model's default cut to what max_model_len leaves after the prompt)
    output_cap_tokens: int | None = None


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    output_tokens: int
    sent_at: float  # time.time() when the engine got the request
    first_token_at: float | None
    finished_at: float
    error: str | None = None
    attempts: int = 1
    usage_reported: bool = False  # token counts from the engine's usage, not counted chunks
    finish_reason: str | None = None  # the engine's ("stop", "length", …), when it said
    # prompt tokens the engine found in its prefix cache, when it said (the usage chunk's
    # ``prompt_tokens_details.cached_tokens``: vLLM with --enable-prompt-tokens-details,
    # providers with prompt caching); None: not reported
    cached_tokens: int | None = None

    @property
    def engine_ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return max(0.0, (self.first_token_at - self.sent_at) * 1000.0)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine itself reports (vLLM ``/health`` and ``/metrics``); None when unknown.

    ``answering`` is False when the engine failed its health probe (refused, an error
    status, no answer in time): the worker then drops its heartbeat until it answers.
    """

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    # vLLM's prefix-cache counters (prompt tokens looked up, found cached; since the engine
    # started): ``workers.prefix_reconcile``; None when the engine does not export them
    prefix_counters: tuple[float, float] | None = None
    answering: bool = True
    problem: str | None = None  # why it is not answering


class EngineUnavailable(RuntimeError):
    """The engine did not answer (refused, timed out, an error status)."""


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, req: GenerationRequest, on_progress: ProgressFn) -> Generation:
        """Run one request to completion; failures are returned in ``Generation.error``."""
        ...

    async def engine_load(self) -> EngineLoad: ...

    async def model_problem(self) -> str | None:
        """Why the engine cannot serve this backend's model (e.g. vLLM's ``GET /v1/models``
        lists other names), or None when it can. Raises ``EngineUnavailable`` when the
        engine does not answer (not started yet, down)."""
        ...
