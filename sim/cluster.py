"""A simulated cluster per ``schemas.ClusterConfig`` (DESIGN.md "One decision core, two worlds").

- Open-weight models (``kind: local``) run on simulated vLLM instances (``sim.engine.SimEngine``),
  one per ``InstanceSpec``, each priced by a step-time source built from the model's
  ``profile`` or explicit ``step_time`` (paper A, Eq. 9) and scheduled by its ``scheduler``.
  Routers see their live state (``InstanceView.state``) and run SFS on it.
- Proprietary models (``kind: cloud``) are endpoints with no live state: routers see
  ``state=None`` and the recent arrival rate, and fall back to paper A's LPS average case.
  The endpoint itself is a simple model: at most ``max_concurrency`` requests in service,
  the rest wait FIFO; a request's admission is also paced by ``rate_limit_rps``; its first
  token comes a network overhead plus a lone prefill (Eq. 9 of its profile) after it enters
  service, with seeded log-normal noise; it holds its slot until its last token.

Prefix caches (issue 14): each simulated vLLM keeps its own prefix cache (``sim.engine``),
and the cluster keeps, per instance, the router's bounded model of it — the LRU that the
service keeps in Redis (``routing.prefix.LruPrefixModel``): a routed query's blocks are
touched when it is sent there and again when it finishes, and the model's capacity is
reconciled with the engine's own hit count every ``RECONCILE_EVERY`` completions. Routers
see that model (``prefix_view="model"``), or the engine's true cache (``"engine"``), or
nothing (``"none"``).

Pure: virtual time only, deterministic given ``seed``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from routing.prefix import LruPrefixModel, full_blocks, reconciled_capacity
from routing.profiles import Profiles
from routing.scheduling import kv_capacity_tokens
from routing.steptime import StepTimeModel
from routing.types import InstanceState, InstanceView
from schemas import ClusterConfig, ModelSpec
from sim.engine import RequestRejected, SimEngine
from sim.timing import LinearTiming, TableTiming, TimingSource

DEFAULT_CLOUD_STEP = StepTimeModel(
    c0_ms=12.0, c1_ms_per_token=0.02, c2_ms_per_ctx_token=2e-5, c3_ms_per_attn_unit=2e-7
)
"""A large model on a provider's GPUs when the config gives no profile (≈ 35 ms for a
1,000-token prefill, ≈ 12 ms per output token)."""

RATE_WINDOW_S = 60.0
"""Look-back of the arrival-rate estimate that routers get for LPS."""

RECONCILE_EVERY = 32
"""Completions per instance between reconciliations of its prefix model with its engine."""

PrefixView = Literal["model", "engine", "none"]


class ClusterError(ValueError):
    """A cluster that cannot be simulated; the message names the model or instance."""


def _profile_model(name: str, profiles: Profiles | None) -> StepTimeModel:
    """Eq. 9 coefficients of a named profile (``routing.profiles``)."""
    if profiles is None:
        raise ClusterError(
            f"profile {name!r}: no step-time profiles were given "
            "(read them with loaders.profiles.profiles_for)"
        )
    try:
        return profiles.model(name)
    except KeyError as exc:
        raise ClusterError(f"profile {name!r}: {exc}") from exc


def step_model_of(spec: ModelSpec, profiles: Profiles | None = None) -> StepTimeModel | None:
    """The Eq. 9 model of a model spec: explicit coefficients win over the profile."""
    if spec.step_time is not None:
        return StepTimeModel.from_coefficients(spec.step_time)
    if spec.profile is not None:
        return _profile_model(spec.profile, profiles)
    return None


def default_timing(
    spec: ModelSpec, noise_sigma: float, profiles: Profiles | None = None
) -> TimingSource:
    """The engine's timing source: the profile's measured-table step time (so the engine is
    not priced by the very Eq. 9 model SFS uses), else Eq. 9 itself, with log-normal noise."""
    if spec.step_time is None and spec.profile is not None:
        if profiles is None:
            raise ClusterError(
                f"model {spec.name!r}: profile {spec.profile!r}: no step-time profiles were "
                "given (read them with loaders.profiles.profiles_for)"
            )
        try:
            return TableTiming.from_profile(profiles, spec.profile, noise_sigma)
        except KeyError as exc:
            raise ClusterError(f"model {spec.name!r}: profile {spec.profile!r}: {exc}") from exc
    model = step_model_of(spec, profiles)
    if model is None:
        raise ClusterError(f"model {spec.name!r} is local but has neither step_time nor profile")
    return LinearTiming(model, noise_sigma)


@dataclass(frozen=True)
class Completion:
    """One request as served: where, when its first token came, when it finished."""

    request_id: str
    instance_id: str
    arrival_s: float
    submit_s: float
    first_token_s: float
    finish_s: float
    error: str | None = None  # the engine refused it (no first token: times are nan)
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_s - self.arrival_s) * 1000.0


@dataclass
class CloudEndpoint:
    """A provider endpoint with no live state (see the module docstring)."""

    instance_id: str
    model: str
    step: StepTimeModel
    max_concurrency: int
    rate_limit_rps: float | None
    network_ms: float = 150.0
    noise_sigma: float = 0.15
    seed: int = 0
    _slots: list[float] = field(default_factory=list)  # heap of finish times of requests in service
    _next_admit_s: float = 0.0
    _rng: np.random.Generator = field(init=False)
    _inflight: list[float] = field(default_factory=list)  # heap of finish times, for free slots

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    def serve(
        self,
        request_id: str,
        arrival_s: float,
        submit_s: float,
        prompt_tokens: int,
        output_tokens: int,
    ) -> Completion:
        start = submit_s
        if self.rate_limit_rps is not None:
            start = max(start, self._next_admit_s)
            self._next_admit_s = start + 1.0 / self.rate_limit_rps
        while self._slots and self._slots[0] <= start:
            heapq.heappop(self._slots)
        if len(self._slots) >= self.max_concurrency:
            start = max(start, heapq.heappop(self._slots))
        noise = (
            float(self._rng.lognormal(-(self.noise_sigma**2) / 2, self.noise_sigma))
            if self.noise_sigma
            else 1.0
        )
        prefill_ms = float(self.step.prefill_ms(prompt_tokens)) * noise
        first = start + (self.network_ms + prefill_ms) / 1000.0
        tpot_ms = float(self.step.step_ms(1, prompt_tokens + output_tokens / 2.0))
        finish = first + max(output_tokens - 1, 0) * tpot_ms / 1000.0
        heapq.heappush(self._slots, finish)
        heapq.heappush(self._inflight, finish)
        return Completion(request_id, self.instance_id, arrival_s, submit_s, first, finish)

    def in_flight(self, now: float) -> int:
        while self._inflight and self._inflight[0] <= now:
            heapq.heappop(self._inflight)
        return len(self._inflight)


class SimCluster:
    """Every instance of a ``ClusterConfig`` in one virtual clock."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        seed: int = 0,
        noise_sigma: float = 0.05,
        oracle_lengths: bool = False,
        timing_factory: Callable[[ModelSpec, float], TimingSource] | None = None,
        prefix_view: PrefixView = "model",
        profiles: Profiles | None = None,
    ) -> None:
        """``profiles``: the step-time profiles the models name (read by the caller);
        ``timing_factory``: each local model's timing source (default ``default_timing``)."""
        if prefix_view not in ("model", "engine", "none"):
            raise ClusterError(f"prefix_view must be model, engine or none, got {prefix_view!r}")
        self.config = config
        self.prefix_view = prefix_view
        self.prefix_models: dict[str, LruPrefixModel] = {}
        self.oracle_lengths = oracle_lengths
        self.instance_ids = [inst.id for inst in config.instances]
        self.models = [inst.model for inst in config.instances]
        self.specs = {m.name: m for m in config.models}
        self.engines: dict[str, SimEngine] = {}
        self.clouds: dict[str, CloudEndpoint] = {}
        timings: dict[str, TimingSource] = {}
        for k, inst in enumerate(config.instances):
            spec = self.specs[inst.model]
            sub_seed = int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
            if spec.kind == "local":
                if spec.name not in timings:
                    timings[spec.name] = (
                        timing_factory(spec, noise_sigma)
                        if timing_factory is not None
                        else default_timing(spec, noise_sigma, profiles)
                    )
                self.engines[inst.id] = SimEngine(
                    timings[spec.name],
                    spec.scheduler,
                    sub_seed,
                    instance_id=inst.id,
                    model=spec.name,
                    max_model_len=spec.max_model_len,
                )
                self.prefix_models[inst.id] = LruPrefixModel(kv_capacity_tokens(spec.scheduler))
            else:
                step = step_model_of(spec, profiles) or DEFAULT_CLOUD_STEP
                self.clouds[inst.id] = CloudEndpoint(
                    inst.id,
                    spec.name,
                    step,
                    spec.max_concurrency,
                    spec.rate_limit_rps,
                    seed=sub_seed,
                )
        self.now = 0.0
        self._recent: dict[str, deque[float]] = {i: deque() for i in self.instance_ids}
        self._arrival: dict[str, float] = {}
        self._submit: dict[str, float] = {}
        self._where: dict[str, str] = {}
        self._first: dict[str, float] = {}
        self.completions: list[Completion] = []
        self._cloud_pending: list[tuple[float, int, Completion]] = []
        self._refused: list[Completion] = []  # refused by an engine, reported on the next advance
        self._seq = 0
        # request -> (its whole prefix blocks, tokens per block, hit tokens the model predicted)
        self._prefix: dict[str, tuple[list[int], float, int]] = {}
        self._recon: dict[str, list[float]] = {}  # instance -> [predicted, engine, completions]

    # ---------------------------------------------------------------- time
    def advance_to(self, t_s: float) -> list[Completion]:
        """Run every instance up to ``t_s``; return the requests that finished by then."""
        if t_s < self.now - 1e-9:
            raise ClusterError(f"advance_to({t_s}) is before the cluster clock {self.now}")
        self.now = max(self.now, t_s)
        done: list[Completion] = []
        for iid, eng in self.engines.items():
            for ev in eng.advance_to(self.now):
                if ev.kind == "first_token":
                    self._first[ev.request_id] = ev.t_s
                else:
                    done.append(self._complete(ev.request_id, iid, ev.t_s, ev.cached_tokens))
        while self._cloud_pending and self._cloud_pending[0][0] <= self.now:
            done.append(heapq.heappop(self._cloud_pending)[2])
        done.extend(self._refused)
        self._refused.clear()
        self.completions.extend(done)
        return done

    def _complete(self, rid: str, iid: str, finish_s: float, cached: int = 0) -> Completion:
        first = self._first.pop(rid, finish_s)
        blocks = self._prefix.pop(rid, None)
        if blocks is not None:
            self._finished_prefix(iid, blocks, cached)
        return Completion(
            rid, iid, self._arrival.pop(rid), self._submit.pop(rid), first, finish_s,
            cached_tokens=cached,
        )  # fmt: skip

    def _finished_prefix(self, iid: str, blocks: tuple[list[int], float, int], cached: int) -> None:
        """The router's model hears of a finish (touch), and is reconciled now and then."""
        model = self.prefix_models[iid]
        hashes, block_tokens, predicted = blocks
        model.touch(np.asarray(hashes, dtype=np.uint64), block_tokens)
        acc = self._recon.setdefault(iid, [0.0, 0.0, 0.0])
        acc[0] += predicted
        acc[1] += cached
        acc[2] += 1
        if acc[2] >= RECONCILE_EVERY:
            cap = kv_capacity_tokens(self.engines[iid].sched)
            model.resize(reconciled_capacity(model.capacity_tokens, cap, acc[0], acc[1]))
            acc[:] = [0.0, 0.0, 0.0]

    def drain(self) -> list[Completion]:
        """Run until every submitted request has finished."""
        done: list[Completion] = []
        while True:
            nxt = [t for t in (e.next_event_s() for e in self.engines.values()) if t is not None]
            if self._cloud_pending:
                nxt.append(self._cloud_pending[0][0])
            if self._refused:
                nxt.append(self.now)
            if not nxt:
                return done
            done.extend(self.advance_to(max(min(nxt), self.now)))

    # -------------------------------------------------------------- inputs
    def submit(
        self,
        request_id: str,
        instance_id: str,
        arrival_s: float,
        prompt_tokens: int,
        output_tokens: int,
        predicted_output_tokens: int | None = None,
        prefix_hashes: list[int] | None = None,
        prefix_block_tokens: float = 512.0,
    ) -> None:
        """Send a request to an instance at the cluster clock (``arrival_s`` is when the
        user sent it: TTFT is counted from there). ``prefix_hashes``: its prompt's block
        hashes (``schemas.prefix``), for the prefix caches."""
        if request_id in self._where:
            raise ClusterError(
                f"request {request_id!r} was already submitted (to {self._where[request_id]})"
            )
        rec = self._recent.get(instance_id)
        if rec is None:
            raise ClusterError(f"request {request_id!r}: unknown instance {instance_id!r}")
        self._where[request_id] = instance_id
        rec.append(self.now)
        if instance_id in self.engines:
            try:
                self.engines[instance_id].submit(
                    request_id,
                    self.now,
                    int(prompt_tokens),
                    int(output_tokens),
                    predicted_output_tokens,
                    prefix_hashes=prefix_hashes,
                    prefix_block_tokens=prefix_block_tokens,
                )
            except RequestRejected as exc:
                nan = float("nan")
                self._refused.append(
                    Completion(request_id, instance_id, arrival_s, self.now, nan, nan, str(exc))
                )
                return
            self._arrival[request_id] = arrival_s
            self._submit[request_id] = self.now
            if prefix_hashes:
                self._routed_prefix(
                    request_id, instance_id, prefix_hashes, prefix_block_tokens, prompt_tokens
                )
        else:
            c = self.clouds[instance_id].serve(
                request_id, arrival_s, self.now, int(prompt_tokens), int(output_tokens)
            )
            self._seq += 1
            heapq.heappush(self._cloud_pending, (c.finish_s, self._seq, c))

    def _routed_prefix(
        self, rid: str, iid: str, hashes: list[int], block_tokens: float, prompt_tokens: int
    ) -> None:
        """The router's model: what it predicts this request finds, then its blocks."""
        model = self.prefix_models[iid]
        whole = hashes[: full_blocks(len(hashes), int(prompt_tokens), block_tokens)]
        lead = model.leading_blocks(hashes)
        predicted = min(int(lead * block_tokens + 1e-9), max(int(prompt_tokens) - 1, 0))
        model.touch(np.asarray(whole, dtype=np.uint64), block_tokens)
        self._prefix[rid] = (whole, block_tokens, predicted)

    def prefix_hit_rate(self) -> dict[str, float]:
        """Per instance, the engine's own prefix-cache hit rate (hit / queried tokens)."""
        out = {}
        for iid, eng in self.engines.items():
            c = eng.prefix_cache
            out[iid] = c.hits / c.queries if c.queries else 0.0
        return out

    # --------------------------------------------------------- observation
    def rate_per_s(self, instance_id: str) -> float:
        rec = self._recent[instance_id]
        while rec and rec[0] < self.now - RATE_WINDOW_S:
            rec.popleft()
        span = min(RATE_WINDOW_S, max(self.now, 1e-9))
        return len(rec) / span

    def views(self) -> list[InstanceView]:
        """What routers see now, one view per instance in config order."""
        out: list[InstanceView] = []
        for iid, model in zip(self.instance_ids, self.models, strict=True):
            spec = self.specs[model]
            eng = self.engines.get(iid)
            cached = None
            if eng is not None:
                state: InstanceState | None = eng.snapshot(oracle=self.oracle_lengths)
                free = max(0, spec.max_concurrency - eng.n_resident)
                if self.prefix_view == "model":
                    cached = self.prefix_models[iid].cached()
                elif self.prefix_view == "engine":
                    cached = eng.cached_hashes()
            else:
                state = None
                free = max(0, spec.max_concurrency - self.clouds[iid].in_flight(self.now))
            out.append(
                InstanceView(iid, model, state, free, 0.0, self.rate_per_s(iid), False, cached)
            )
        return out

    def n_in_system(self) -> int:
        return len(self._where) - len(self.completions)

    @property
    def local_ids(self) -> Sequence[str]:
        return list(self.engines)

    def gpus(self) -> int:
        return sum(self.specs[m].gpus_per_instance for m in self.models)
