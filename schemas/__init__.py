"""Wire schemas: every body that crosses a process boundary (pydantic v2)."""

from schemas.cluster import (
    ClusterConfig,
    InstanceSpec,
    ModelSpec,
    SchedulerConfig,
    StepTimeCoefficients,
    TenantBudget,
)
from schemas.messages import (
    DeadLetter,
    Decision,
    DecisionFlag,
    DecisionStatus,
    RelayChunk,
    Result,
    ResultCode,
    RoutedQuery,
    WindowStats,
    decision_bytes,
    decision_trusted,
    decision_with,
    routed_query_bytes,
    routed_query_raw,
    trusted_decisions,
)
from schemas.parse import BadMessage, Limits, decode_json, parse_model, parse_query
from schemas.query import ChatMessage, Query
from schemas.state import FinishedRequest, InstanceSnapshot, ResidentRequest

TOPIC_BODIES = {
    "queries": Query,
    "route.<instance>": RoutedQuery,
    "decisions": Decision,
    "results": Result,
    "dead-letters": DeadLetter,
    "relay.<gateway>": RelayChunk,
    "cluster-config": ClusterConfig,
    "instance-snapshot": InstanceSnapshot,
}

__all__ = [
    "TOPIC_BODIES",
    "BadMessage",
    "ChatMessage",
    "ClusterConfig",
    "DeadLetter",
    "Decision",
    "DecisionFlag",
    "DecisionStatus",
    "FinishedRequest",
    "InstanceSnapshot",
    "InstanceSpec",
    "Limits",
    "ModelSpec",
    "Query",
    "RelayChunk",
    "ResidentRequest",
    "Result",
    "ResultCode",
    "RoutedQuery",
    "SchedulerConfig",
    "StepTimeCoefficients",
    "TenantBudget",
    "WindowStats",
    "decode_json",
    "decision_bytes",
    "decision_trusted",
    "trusted_decisions",
    "decision_with",
    "routed_query_bytes",
    "routed_query_raw",
    "parse_model",
    "parse_query",
]
