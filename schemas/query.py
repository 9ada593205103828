"""Query: one LLM request as produced to the ``queries`` topic.

The body accepts the OpenAI completion and chat request fields (``prompt`` or
``messages``, ``max_tokens``, ``temperature`` ...) plus the routing fields
(``id``, ``ttft_slo_ms``, ``tenant``, ``prompt_tokens``, ``created_at``) and, optionally,
the prompt's prefix identity (``prefix_hashes``, ``prefix_block_tokens``; ``schemas.prefix``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Annotated, Any, Generic, Literal, Self, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from schemas.prefix import MAX_PREFIX_BLOCKS, text_block_hashes, text_block_tokens

MAX_SLO_MS = 3_600_000.0  # one hour: anything larger is a unit mistake, not an SLO
QUERY_ID_PATTERN = r"^[A-Za-z0-9_.:\-]{1,128}$"
TENANT_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
RELAY_TOPIC_PATTERN = r"^relay\.[A-Za-z0-9_\-]{1,100}$"

QueryId = Annotated[str, Field(pattern=QUERY_ID_PATTERN)]


class ChatMessage(BaseModel):
    """One OpenAI chat message; ``content`` may be text or a list of text parts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)


_T = TypeVar("_T")


class _memo(cached_property[_T], Generic[_T]):  # noqa: N801 - a decorator, as cached_property
    """``functools.cached_property`` without its lock (Python 3.11 takes one on every first
    access, ~0.3 µs; 3.12 dropped it): the value goes into the instance's ``__dict__``,
    where the next access finds it before the descriptor. Computing it twice at once (two
    threads) gives the same value."""

    def __init__(self, func: Callable[[Any], _T]) -> None:
        super().__init__(func)

    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> Self: ...
    @overload
    def __get__(self, instance: object, owner: type[Any] | None = None) -> _T: ...
    def __get__(self, instance: object | None, owner: type[Any] | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.attrname] = self.func(instance)  # type: ignore[index]
        return value


class Query(BaseModel):
    """A query to route. Exactly one of ``prompt`` (completion) or ``messages`` (chat)."""

    # ``_memo``: the text measures, kept outside the fields (``_MEMO``)
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, ignored_types=(_memo,)
    )

    # routing fields
    id: QueryId
    tenant: str = Field(default="default", pattern=TENANT_PATTERN)
    ttft_slo_ms: float = Field(default=2_000.0, gt=0, le=MAX_SLO_MS)
    prompt_tokens: int | None = Field(default=None, ge=0, le=10_000_000)
    created_at: float | None = Field(default=None, ge=0, le=1e11)
    task: str | None = Field(default=None, max_length=128)
    # Prefix identity (schemas.prefix): chained hashes of the prompt's leading blocks of
    # ``prefix_block_tokens`` tokens each, hash i naming blocks 0..i (the Mooncake trace's
    # hash_ids, or vLLM's block hashes). None: derived from the prompt text.
    prefix_hashes: list[Annotated[int, Field(ge=0, lt=2**64)]] | None = Field(
        default=None, max_length=MAX_PREFIX_BLOCKS
    )
    prefix_block_tokens: int = Field(default=512, ge=1, le=1_048_576)

    # OpenAI completion / chat request fields
    model: str | None = Field(default=None, max_length=256)
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's sampling extensions of the OpenAI API, passed through to the engine
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    echo: bool | None = None
    suffix: str | None = None
    user: str | None = Field(default=None, max_length=256)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None

    # front-door fields: where a worker relays the engine's chunks as they stream
    # (``relay.<gateway>``, set by ``switchyard gateway`` for ``stream: true`` requests)
    relay_topic: str | None = Field(default=None, pattern=RELAY_TOPIC_PATTERN)

    @field_validator("ttft_slo_ms")
    @classmethod
    def _finite_slo(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @field_validator("n", "best_of")
    @classmethod
    def _one_completion(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value > 1:
            raise ValueError(
                f"must be 1, got {value}: a query gets one completion (send {value} queries "
                "instead)"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.lstrip("-").isdigit() or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"must map token ids to a bias within [-100, 100], got {token!r}: {bias!r}"
                )
        return value

    @model_validator(mode="after")
    def _one_prompt(self, info: ValidationInfo) -> Query:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        cap = None
        if info.context and isinstance(info.context, dict):
            cap = info.context.get("max_prompt_bytes")
        if cap is not None:
            size = self.text_size_bytes  # measured once, kept for the router (_MEMO)
            if size > cap:
                raise ValueError(f"prompt is {size} bytes, over the cap of {cap} bytes")
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """``BaseModel.model_copy``, without the text measures of ``self`` when ``update``
        may change the text (``_MEMO``)."""
        copied = super().model_copy(update=update, deep=deep)
        if update:
            for name in _MEMO:
                copied.__dict__.pop(name, None)
        return copied

    @_memo
    def text_size_bytes(self) -> int:
        """UTF-8 bytes of ``text()``, measured once per query (the router asks for it in
        several places of a window: reservation, prefix model, cost and length estimates)."""
        text = self.text()
        # ASCII is one byte a character (``isascii`` reads a flag the string keeps)
        return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))

    @_memo
    def text_prefix_hashes(self) -> tuple[int, ...]:
        """``schemas.prefix.text_block_hashes`` of ``text()``, computed once per query."""
        return tuple(text_block_hashes(self.text()))

    @_memo
    def prefix_identity(self) -> tuple[tuple[int, ...], float]:
        """``prefix_blocks`` once per query, the hashes as a tuple (the router reads them
        three times a window: its prefix hits, the predicted cached tokens, the touches)."""
        if self.prefix_hashes is not None:
            return tuple(self.prefix_hashes), float(self.prefix_block_tokens)
        return self.text_prefix_hashes, text_block_tokens(self.text_size_bytes, self.prompt_tokens)

    @property
    def kind(self) -> Literal["completion", "chat"]:
        return "chat" if self.messages is not None else "completion"

    def text(self) -> str:
        """The prompt text the model will read (chat messages joined by newlines)."""
        if self.messages is not None:
            return "\n".join(m.text() for m in self.messages)
        if isinstance(self.prompt, list):
            return "\n".join(self.prompt)
        return self.prompt or ""

    def output_cap_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_tokens_upper_bound(self) -> int:
        """At most this many prompt tokens: one per UTF-8 byte (byte-level BPE never does
        worse) plus chat-template tokens, or the producer's count if that is larger."""
        size = self.text_size_bytes
        template = 8 + 8 * len(self.messages) if self.messages is not None else 2
        return max(size + template, self.prompt_tokens or 0)

    def prefix_blocks(self) -> tuple[list[int], float]:
        """The prompt's prefix block hashes and the tokens each block stands for: its own
        ``prefix_hashes`` when given, else derived from the text (``schemas.prefix``)."""
        hashes, block_tokens = self.prefix_identity
        return list(hashes), block_tokens

    def estimated_prompt_tokens(self) -> int:
        """``prompt_tokens`` when the producer gave it, else ~4 bytes per token."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return max(1, math.ceil(self.text_size_bytes / 4))


# the text measures a Query keeps once asked (``_memo``: in its ``__dict__``, outside its
# fields, so neither equality nor serialisation sees them); ``Query.model_copy`` with an
# update drops them
_MEMO = ("text_size_bytes", "text_prefix_hashes", "prefix_identity")
