"""Live state of a serving instance, as workers write it and routers read it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.query import QueryId


class ResidentRequest(BaseModel):
    """One request on an instance: waiting (prefilled 0), prefilling, or decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    query_id: QueryId
    prompt_tokens: int = Field(ge=0)
    prefilled_tokens: int = Field(default=0, ge=0)
    decoded_tokens: int = Field(default=0, ge=0)
    predicted_output_tokens: int = Field(default=128, ge=1)
    arrived_at: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _progress(self) -> ResidentRequest:
        if self.prefilled_tokens > self.prompt_tokens:
            raise ValueError(
                f"prefilled_tokens ({self.prefilled_tokens}) must be <= prompt_tokens ({self.prompt_tokens})"
            )
        if self.decoded_tokens > 0 and self.prefilled_tokens < self.prompt_tokens:
            raise ValueError("decoded_tokens must be 0 until the prompt is fully prefilled")
        return self


class FinishedRequest(BaseModel):
    """A request that left the instance recently: when it reached the engine
    (``arrived_at``), when its last token came (``finished_at``), its prompt and the output
    tokens it produced. Routers replay these with the residents where the engine reports no
    prefill progress (``routing.sfs.catch_up``): they took engine time the residents waited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=1)
    arrived_at: float = Field(ge=0)
    finished_at: float = Field(ge=0)

    @model_validator(mode="after")
    def _order(self) -> FinishedRequest:
        if self.finished_at < self.arrived_at:
            raise ValueError(
                f"finished_at ({self.finished_at}) must not be before arrived_at ({self.arrived_at})"
            )
        return self


class InstanceSnapshot(BaseModel):
    """An instance's resident requests at ``taken_at`` (unix seconds, or virtual time), and
    the requests that left it recently (``finished``, the last closed first, bounded by the
    writer)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_id: str
    model: str
    taken_at: float = Field(ge=0)
    residents: list[ResidentRequest] = Field(default_factory=list)
    finished: list[FinishedRequest] = Field(default_factory=list)
    healthy: bool = True
    source: str = "redis"

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.taken_at)

    def is_stale(self, now: float, max_age_s: float) -> bool:
        return self.age_s(now) > max_age_s
