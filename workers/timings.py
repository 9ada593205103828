"""Observed timings a worker reports for online recalibration of the step-time model (Eq. 9).

Published to the ``step-timings`` topic (``wiring.topics.STEP_TIMINGS``), key = the
instance id, JSON body = one of:

``{"kind": "steps", ...}`` — ``StepBatch``: engine steps executed (the ``sim`` backend,
whose engine reports every step). Columns are parallel arrays, one entry per step:
``n_tokens`` (tokens batched), ``decode_ctx_tokens`` (sum of the decodes' contexts),
``prefill_attn_units`` (sum of q·(q/2+ctx) over prefill chunks) and ``duration_ms``.
These are exactly the columns of ``routing.steptime.features`` plus the target, so a
recalibrator fits ``routing.steptime.fit_nnls`` on them directly.

``{"kind": "request", ...}`` — ``RequestTiming``: one finished request as the worker saw it
(any backend, including a real vLLM server, which does not expose per-step times):
engine-side TTFT (request sent → first token), end-to-end time, prompt and output tokens,
and ``residents_ahead`` (requests this worker already had running on the engine when it
was sent). With ``residents_ahead == 0`` the TTFT is one lone prefill, i.e. Eq. 9's
``StepTimeModel.prefill_ms(prompt_tokens)``; ``tpot_ms`` is the mean decode step time.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class StepBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["steps"] = "steps"
    instance_id: str
    model: str
    at: float  # unix seconds when reported
    n_tokens: list[float]
    decode_ctx_tokens: list[float]
    prefill_attn_units: list[float]
    duration_ms: list[float]


class RequestTiming(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["request"] = "request"
    instance_id: str
    model: str
    query_id: str
    at: float
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    engine_ttft_ms: float | None = Field(default=None, ge=0)
    engine_e2e_ms: float = Field(ge=0)
    tpot_ms: float | None = Field(default=None, ge=0)
    residents_ahead: int = Field(ge=0)
    backend: str


StepTimingReport = Annotated[StepBatch | RequestTiming, Field(discriminator="kind")]
REPORT_ADAPTER: TypeAdapter[StepBatch | RequestTiming] = TypeAdapter(StepTimingReport)

MAX_STEPS_PER_MESSAGE = 8192


def parse_report(raw: bytes) -> StepBatch | RequestTiming:
    return REPORT_ADAPTER.validate_json(raw)
