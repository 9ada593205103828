"""Model, instance and cluster configuration (loadable from YAML or JSON)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.query import TENANT_PATTERN, Query

INSTANCE_ID_PATTERN = r"^[A-Za-z0-9_\-]{1,100}$"


class SchedulerConfig(BaseModel):
    """The serving framework's batching policy and its limits (vLLM engine args)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["vllm-v1", "sarathi", "vllm-v0"] = "vllm-v1"
    max_num_batched_tokens: int = Field(default=8192, ge=1, le=1_048_576)
    max_num_seqs: int = Field(default=256, ge=1, le=65_536)
    chunk_size_tokens: int = Field(default=512, ge=1, le=1_048_576)  # Sarathi-Serve only
    kv_blocks: int = Field(default=1_000_000, ge=1)
    block_size_tokens: int = Field(default=16, ge=1, le=4096)
    shared_prefix_tokens: int = Field(default=0, ge=0)  # prefix-cache hit for every request
    prefix_caching: bool = True  # vLLM's --enable-prefix-caching (real servers; on by default)


class StepTimeCoefficients(BaseModel):
    """Paper A's Eq. 9: t = c0 + c1·N_tokens + c2·Σ decode ctx + c3·Σ q·(q/2 + ctx), in ms."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    c0_ms: float = Field(ge=0)
    c1_ms_per_token: float = Field(ge=0)
    c2_ms_per_ctx_token: float = Field(ge=0)
    c3_ms_per_attn_unit: float = Field(ge=0)


class ModelSpec(BaseModel):
    """One model: prices, serving shape and timing."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=128)
    kind: Literal["local", "cloud"] = "local"
    input_usd_per_token: float = Field(ge=0, le=1.0)
    output_usd_per_token: float = Field(ge=0, le=1.0)
    # Price of a prompt token the engine finds in its prefix cache (a hit skips its prefill).
    # None: the input price (no discount). Large API providers bill cache reads at 10-25% of
    # the input price; for a self-hosted engine the input price stands for the prefill
    # compute that a hit skips. At most the input price. The simulator bills the engine's
    # cached tokens at it, and the service's worker the cached tokens the engine reports in
    # its usage (vLLM with --enable-prompt-tokens-details, as `services up --vllm` starts it;
    # providers with prompt caching). With an engine that reports none, leave it unset in a
    # service with a money budget: the router would predict less spend than is billed.
    cached_input_usd_per_token: float | None = Field(default=None, ge=0, le=1.0)
    gpus_per_instance: int = Field(default=1, ge=0, le=1024)
    max_concurrency: int = Field(default=64, ge=1, le=65_536)
    profile: str | None = None  # step-time profile name, e.g. "llama-2-7b-hf@h100"
    step_time: StepTimeCoefficients | None = None  # explicit coefficients win over `profile`
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    # A cloud endpoint's request rate limit: its worker admits requests at least 1/rate s
    # apart (workers.pacing), as the simulator's cloud endpoint does. Cloud models only: a
    # local engine admits what its scheduler fits, and the simulator models no limit there.
    rate_limit_rps: float | None = Field(default=None, gt=0)
    mean_output_tokens: float | None = Field(default=None, gt=0)
    # Output cap sent to the engine when a query sets none (cut to what max_model_len leaves
    # after the prompt: ``default_output_cap_tokens``); the budget ledger reserves up to it.
    max_output_tokens: int = Field(default=4096, ge=1, le=1_000_000)
    # The engine's context window (vLLM ``--max-model-len``): prompt + output tokens of one
    # request must fit in it. None: not known (no length check against the model).
    max_model_len: int | None = Field(default=None, ge=1, le=16_777_216)
    # The predictor column this model's quality and output length are read from, when the
    # predictor was not trained on this model: a stand-in of its tier (a new fine-tune, a
    # renamed deployment, the random-weight CPU models of real-vllm-cpu.yaml). None: ``name``.
    quality_as: str | None = Field(default=None, min_length=1, max_length=128)
    # What the workers' engine says about prefill before a request's first token. "reported":
    # its progress (the simulated engine reports each chunk), so a snapshot is current.
    # "inferred": nothing (a real vLLM streams nothing until the first token), so the router
    # infers it from how long each resident has been at the engine and takes the step in
    # flight into account (routing.sfs.catch_up).
    prefill_progress: Literal["reported", "inferred"] = "reported"

    @property
    def predictor_key(self) -> str:
        """The name the quality and length predictors know this model by."""
        return self.quality_as or self.name

    def context_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold on an instance of this
        model: ``max_model_len`` when known, and never more than the KV cache holds
        (``scheduler.kv_blocks`` × ``block_size_tokens``; vLLM refuses to start with a
        ``--max-model-len`` its cache cannot hold, so the smaller of the two is the limit)."""
        kv = self.scheduler.kv_blocks * self.scheduler.block_size_tokens
        return kv if self.max_model_len is None else min(self.max_model_len, kv)

    @model_validator(mode="after")
    def _prices_and_limits(self) -> ModelSpec:
        c = self.cached_input_usd_per_token
        if c is not None and c > self.input_usd_per_token:
            raise ValueError(
                f"model {self.name}: cached_input_usd_per_token ({c:g}) must be <= "
                f"input_usd_per_token ({self.input_usd_per_token:g})"
            )
        if self.rate_limit_rps is not None and self.kind != "cloud":
            raise ValueError(
                f"model {self.name}: rate_limit_rps is for kind: cloud (a provider's limit); "
                f"a local engine's pace is its scheduler's"
            )
        return self

    @property
    def cached_input_price(self) -> float:
        """USD per prompt token found in the prefix cache (the input price by default)."""
        c = self.cached_input_usd_per_token
        return self.input_usd_per_token if c is None else c

    def cost_usd(
        self, prompt_tokens: float, output_tokens: float, cached_tokens: float = 0.0
    ) -> float:
        """Input tokens at the input price, those of them found cached at the cached-input
        price, output tokens at the output price."""
        discount = (self.input_usd_per_token - self.cached_input_price) * cached_tokens
        return (
            self.input_usd_per_token * prompt_tokens
            - discount
            + self.output_usd_per_token * output_tokens
        )

    def default_output_cap_tokens(self, prompt_tokens: int) -> int:
        """The cap sent for a query that sets none: ``max_output_tokens``, cut to what the
        context leaves after the prompt (vLLM answers 400 to a ``max_tokens`` that does not
        fit), and at least 1."""
        return max(1, min(self.max_output_tokens, self.context_tokens() - prompt_tokens))

    def output_cap_tokens(self, query: Query, prompt_tokens: int | None = None) -> int:
        """The most output tokens ``query`` may produce here: its own cap, else
        ``default_output_cap_tokens`` of its prompt (``prompt_tokens``, by default the
        query's own estimate, which is what the router and the worker both count)."""
        own = query.output_cap_tokens()
        if own:
            return own
        if prompt_tokens is None:
            prompt_tokens = query.estimated_prompt_tokens()
        return self.default_output_cap_tokens(prompt_tokens)

    def max_cost_usd(self, query: Query) -> float:
        """An upper bound of what ``query`` can cost on this model.

        What the ledger reserves, so that settling the real cost can never push spend past
        a budget: prompt tokens bounded by the prompt's bytes (every token covers >= 1 byte,
        plus chat-template overhead), output bounded by the cap the worker sends the engine.
        """
        return self.cost_usd(query.prompt_tokens_upper_bound(), self.output_cap_tokens(query))

    def max_costs_usd(self, queries: Sequence[Query]) -> npt.NDArray[np.float64]:
        """``max_cost_usd`` of each query, as one array: the same floats (the same
        operations in the same order, elementwise), at under half the Python per query;
        the router reserves a window's worst cases with it."""
        n = len(queries)
        prompt = np.fromiter([q.prompt_tokens_upper_bound() for q in queries], np.float64, n)
        own = np.fromiter([q.output_cap_tokens() or 0 for q in queries], np.float64, n)
        cap = own
        if n and not own.all():  # a query without a cap of its own: the model's default
            estimated = np.fromiter([q.estimated_prompt_tokens() for q in queries], np.float64, n)
            left = self.context_tokens() - estimated
            default = np.maximum(1.0, np.minimum(float(self.max_output_tokens), left))
            cap = np.where(own > 0, own, default)
        # cost_usd's discount for no cached tokens is ±0.0, and prices and tokens are >= 0:
        # subtracting it leaves every value as it is, so it is left out
        out: npt.NDArray[np.float64] = (
            self.input_usd_per_token * prompt + self.output_usd_per_token * cap
        )
        return out


class InstanceSpec(BaseModel):
    """One serving instance of a model. Its queries go to the topic ``route.<id>``
    (``wiring.topics.route``), for the router, its rescuer and the worker alike."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=INSTANCE_ID_PATTERN)
    model: str
    endpoint: str | None = None  # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000


ANY_MODEL = "auto"  # a query's ``model`` that leaves the choice to the router
API_KEY_SHA256_PATTERN = r"^[0-9a-f]{64}$"


class TenantBudget(BaseModel):
    """A tenant's budget per period and the API keys (SHA-256, hex) that act for it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    tenant: str = Field(pattern=TENANT_PATTERN)
    budget_usd: float = Field(ge=0)
    period_s: float = Field(default=86_400.0, gt=0)
    # the gateway (``switchyard gateway``) maps a bearer key to this tenant when the key's
    # SHA-256 is listed here; keys themselves are never stored (``switchyard api-key``)
    api_keys_sha256: list[str] = Field(default_factory=list)

    @field_validator("api_keys_sha256")
    @classmethod
    def _hashes(cls, value: list[str]) -> list[str]:
        for h in value:
            if not re.fullmatch(API_KEY_SHA256_PATTERN, h):
                raise ValueError(
                    f"must be SHA-256 hex digests (64 lowercase hex digits), got {h[:12]!r}…; "
                    "`switchyard api-key` prints a key and its digest"
                )
        return value


class ClusterConfig(BaseModel):
    """Models, their instances and tenant budgets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[ModelSpec] = Field(min_length=1)
    instances: list[InstanceSpec] = Field(min_length=1)
    tenants: list[TenantBudget] = Field(default_factory=list)
    # names a query's ``model`` may give for a set of models, e.g. {small: [m1, m2]}
    model_groups: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique, repeated: {sorted(dup)}")
        ids = [i.id for i in self.instances]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"instance ids must be unique, repeated: {sorted(dup)}")
        known = set(names)
        for inst in self.instances:
            if inst.model not in known:
                raise ValueError(f"instance {inst.id!r} names unknown model {inst.model!r}")
        for group, members in self.model_groups.items():
            if group in known:
                raise ValueError(f"model group {group!r} has the name of a model")
            unknown = [m for m in members if m not in known]
            if not members or unknown:
                raise ValueError(
                    f"model group {group!r} must list known models, got unknown {unknown} "
                    f"(known: {names})"
                    if unknown
                    else f"model group {group!r} is empty"
                )
        return self

    def models_named(self, name: str) -> list[str]:
        """The models a query's ``model`` field allows: the model itself, a group's members,
        or every model for ``auto``.

        ``KeyError`` naming what is known when ``name`` is neither.
        """
        if name in self.model_groups:
            return list(self.model_groups[name])
        if name in self._models_by_name:
            return [name]
        if name == ANY_MODEL:
            return [m.name for m in self.models]
        groups = f"; groups: {sorted(self.model_groups)}" if self.model_groups else ""
        raise KeyError(
            f"model {name!r} is not served by this cluster; models: "
            f"{[m.name for m in self.models]}{groups}"
        )

    # What ``model``, ``instance`` and ``model_of`` read: model name -> spec, instance id ->
    # (instance, its model). Built on first use and kept in ``__dict__`` (``cached_property``:
    # read as fast as a field, which a pydantic private attribute is not; outside the
    # fields, so equality and serialisation do not see it); ``model_copy`` keeps it true.
    @cached_property
    def _models_by_name(self) -> dict[str, ModelSpec]:
        return {m.name: m for m in self.models}

    @cached_property
    def _instances_by_id(self) -> dict[str, tuple[InstanceSpec, ModelSpec]]:
        return {i.id: (i, self._models_by_name[i.model]) for i in self.instances}

    def model(self, name: str) -> ModelSpec:
        spec = self._models_by_name.get(name)
        if spec is None:
            raise KeyError(f"unknown model {name!r}; known: {[m.name for m in self.models]}")
        return spec

    def model_of(self, instance_id: str) -> ModelSpec:
        return self._indexed(instance_id)[1]

    def instance(self, instance_id: str) -> InstanceSpec:
        return self._indexed(instance_id)[0]

    def _indexed(self, instance_id: str) -> tuple[InstanceSpec, ModelSpec]:
        found = self._instances_by_id.get(instance_id)
        if found is None:
            raise KeyError(
                f"unknown instance {instance_id!r}; known: {[i.id for i in self.instances]}"
            )
        return found

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; with ``update``, validated anew. (Pydantic's copy leaves an update
        unvalidated: a copy with new instances would skip the cross-checks above and keep
        the lookups built from the old ones.)"""
        if not update:
            return super().model_copy(deep=deep)
        copy = type(self).model_validate({**dict(self), **update})
        return copy.model_copy(deep=True) if deep else copy

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterConfig:
        """Load from ``.yaml``/``.yml`` or ``.json``; errors name the file and the field."""
        p = Path(path)
        text = p.read_text(encoding="utf-8")
        data: Any
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.model_validate(data)
