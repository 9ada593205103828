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


class InstanceSnapshot(BaseModel):
    """An instance's resident requests at ``taken_at`` (unix seconds, or virtual time)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_id: str
    model: str
    taken_at: float = Field(ge=0)
    residents: list[ResidentRequest] = Field(default_factory=list)
    healthy: bool = True
    source: str = "redis"

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.taken_at)

    def is_stale(self, now: float, max_age_s: float) -> bool:
        return self.age_s(now) > max_age_s
