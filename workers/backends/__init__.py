"""Inference backends a worker drives: a real vLLM server over HTTP, or the simulated engine."""

from workers.backends.base import (
    Backend,
    EngineLoad,
    EngineUnavailable,
    Generation,
    GenerationRequest,
    ProgressFn,
)

__all__ = [
    "Backend",
    "EngineLoad",
    "EngineUnavailable",
    "Generation",
    "GenerationRequest",
    "ProgressFn",
]
