"""What every policy is built from: the cluster, the predictors and a TTFT model.

Routers receive live state and never fetch; the context is built once, from what the
caller read (the step-time profiles a model names come in as ``routing.profiles.Profiles``).
Predictors are typed as small protocols so that the trained artefacts of
``routing.quality`` / ``routing.length`` and test fakes both fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from routing.prefix import ColumnPrefix
from routing.profiles import Profiles
from routing.steptime import StepTimeModel
from routing.types import FloatArray, InstanceState, InstanceView, IntArray
from schemas import ClusterConfig, ModelSpec

if TYPE_CHECKING:
    from routing.sfs import LaterArrivals

DEFAULT_OUTPUT_TOKENS = 256.0


@runtime_checkable
class QualityEstimateLike(Protocol):
    mean: FloatArray
    lower: FloatArray


class QualityModel(Protocol):
    """``routing.quality.QualityPredictor`` or a fake: per-(query, model) quality."""

    @property
    def models(self) -> Sequence[str]: ...

    def predict(self, texts: Sequence[str]) -> QualityEstimateLike: ...


class LengthModel(Protocol):
    """``routing.length.LengthPredictor`` or a fake: predicted output tokens [n, m]."""

    @property
    def models(self) -> Sequence[str]: ...

    def predict(self, texts: Sequence[str], prompt_tokens: IntArray) -> FloatArray: ...


class TtftModel(Protocol):
    """TTFT (ms from now) of new queries on one instance.

    ``standalone_ms``: each candidate appended alone (for pruning pairs).
    ``in_order_ms``: all appended FCFS in the given order (the re-check).
    ``is_estimate``: True when the answer is the LPS average case (no live state).
    ``prefix``: the candidates' prefix-cache hits there (and, in order, what they share
    with each other); None: no prefix is cached.
    ``over_ms`` (``in_order_ms``; one bound per candidate, ``inf``: none): the caller needs
    only the first candidate in order whose TTFT exceeds its bound; a model may then stop
    there (``routing.sfs.estimate_ttft_ms``), that candidate's TTFT a lower bound already
    over it and the candidates after it NaN. Every TTFT it does return is the one it would
    return without ``over_ms``; a model may also ignore it.
    """

    def standalone_ms(
        self,
        view: InstanceView,
        prompt_tokens: IntArray,
        output_tokens: IntArray,
        prefix: ColumnPrefix | None = None,
    ) -> FloatArray: ...

    def in_order_ms(
        self,
        view: InstanceView,
        prompt_tokens: IntArray,
        output_tokens: IntArray,
        prefix: ColumnPrefix | None = None,
        over_ms: FloatArray | None = None,
    ) -> FloatArray: ...

    def is_estimate(self, view: InstanceView) -> bool: ...


@dataclass
class SfsTtft:
    """Paper A's estimators: SFS over live state, LPS when there is none.

    Models without a step-time model (e.g. a cloud endpoint with no profile) get
    TTFT 0 and count as estimates: their latency is not constrained. Every other TTFT
    counts from decision time: the view's ``dispatch_ms`` (decision → engine, and the
    server's own time per request) is added. For a model whose engine reports no prefill
    progress (``ModelSpec.prefill_progress == "inferred"``, a real vLLM) the snapshot is
    first caught up to decision time (``routing.sfs.catch_up``: prefill done since each
    resident arrived, with the requests that left meanwhile (``view.finished``), and the step
    in flight), each decoding resident's output length is conditioned on what it has decoded
    over those finished requests' lengths (``routing.sfs.with_conditional_lengths``), and a
    candidate priced alone (``standalone_ms``) also pays for the requests
    expected after it in its last prefill step (``routing.sfs.LaterArrivals``).
    """

    cluster: ClusterConfig
    step_time: Mapping[str, StepTimeModel]
    # the last catch-up per instance: a window asks for one view's TTFTs more than once
    _caught: dict[
        str, tuple[InstanceView, InstanceState, StepTimeModel, InstanceState, float]
    ] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _spec(self, view: InstanceView) -> ModelSpec:
        return self.cluster.model(view.model)

    def _step(self, view: InstanceView) -> StepTimeModel | None:
        """The coefficients refitted online (``view.step_time``), else the configured ones."""
        return view.step_time if view.step_time is not None else self.step_time.get(view.model)

    def is_estimate(self, view: InstanceView) -> bool:
        return view.state is None or view.stale or self._step(view) is None

    def _now_state(
        self, view: InstanceView, state: InstanceState, model: StepTimeModel
    ) -> tuple[InstanceState, float]:
        """The state SFS starts from and the delay before the engine's next step."""
        spec = self._spec(view)
        if spec.prefill_progress != "inferred" or view.waited_ms is None:
            return state, 0.0
        hit = self._caught.get(view.instance_id)
        if hit is not None and hit[0] is view and hit[1] is state and hit[2] == model:
            return hit[3], hit[4]  # the same view again (standalone, then in order)
        from routing.sfs import catch_up, with_conditional_lengths

        caught, delay = catch_up(state, view.waited_ms, model, spec.scheduler, view.finished)
        caught = with_conditional_lengths(caught, view.finished)
        self._caught[view.instance_id] = (view, state, model, caught, delay)
        return caught, delay

    def _later(self, view: InstanceView, state: InstanceState) -> LaterArrivals | None:
        """For a model whose engine reports no prefill progress, the requests expected to
        arrive after a candidate (the snapshot's last second), priced in its last prefill
        step (``routing.sfs.LaterArrivals``); None elsewhere."""
        if self._spec(view).prefill_progress != "inferred" or view.waited_ms is None:
            return None
        from routing.sfs import later_arrivals

        return later_arrivals(state, view.waited_ms, view.finished)

    def _lps(
        self, view: InstanceView, prompt_tokens: IntArray, output_tokens: IntArray
    ) -> FloatArray:
        from routing.lps import lps_ttft_ms

        model = self._step(view)
        if model is None or prompt_tokens.size == 0:
            return np.zeros(prompt_tokens.size)
        spec = self._spec(view)
        t = lps_ttft_ms(
            view.arrival_rate_per_s,
            float(prompt_tokens.mean()),
            max(1.0, float(output_tokens.mean())),
            spec.max_concurrency,
            model,
            spec.scheduler,
        )
        return np.full(prompt_tokens.size, t if math.isfinite(t) else 3.6e6)

    def _never(self, view: InstanceView, prompt_tokens: IntArray, ttft: FloatArray) -> FloatArray:
        """A prompt beyond the model's context (``max_model_len``) is never served there;
        any other TTFT gets the dispatch delay."""
        from routing.sfs import UNSERVABLE_MS

        limit = self._spec(view).context_tokens()
        if self._step(view) is not None and view.dispatch_ms > 0:
            ttft = ttft + view.dispatch_ms
        out: FloatArray = np.where(prompt_tokens + 1 > limit, UNSERVABLE_MS, ttft)
        return out

    def standalone_ms(
        self,
        view: InstanceView,
        prompt_tokens: IntArray,
        output_tokens: IntArray,
        prefix: ColumnPrefix | None = None,
    ) -> FloatArray:
        model = self._step(view)
        if view.state is None or view.stale or model is None:
            return self._never(view, prompt_tokens, self._lps(view, prompt_tokens, output_tokens))
        from routing.sfs import standalone_ttft_ms

        spec = self._spec(view)
        state, delay = self._now_state(view, view.state, model)
        ttft = standalone_ttft_ms(
            state,
            prompt_tokens,
            model,
            spec.scheduler,
            start_delay_ms=delay,
            hit_tokens=None if prefix is None else prefix.hit_tokens,
            later=self._later(view, view.state),
        )
        return self._never(view, prompt_tokens, ttft)

    def in_order_ms(
        self,
        view: InstanceView,
        prompt_tokens: IntArray,
        output_tokens: IntArray,
        prefix: ColumnPrefix | None = None,
        over_ms: FloatArray | None = None,
    ) -> FloatArray:
        model = self._step(view)
        if view.state is None or view.stale or model is None:
            return self._never(view, prompt_tokens, self._lps(view, prompt_tokens, output_tokens))
        from routing.sfs import UNSERVABLE_MS, estimate_ttft_ms

        spec = self._spec(view)
        state, delay = self._now_state(view, view.state, model)
        added = view.dispatch_ms if view.dispatch_ms > 0 else 0.0  # as ``_never`` adds it
        if over_ms is not None:
            # a prompt beyond the context is answered UNSERVABLE_MS by ``_never`` whatever SFS
            # says: over its bound from the start (-inf), or never (inf)
            beyond = prompt_tokens + 1 > spec.context_tokens()
            never_over = np.where(UNSERVABLE_MS > over_ms, -np.inf, np.inf)
            over_ms = np.where(beyond, never_over, over_ms)
        ttft = estimate_ttft_ms(
            state,
            prompt_tokens,
            model,
            spec.scheduler,
            start_delay_ms=delay,
            output_tokens=np.maximum(output_tokens, 1),
            hit_tokens=None if prefix is None else prefix.hit_tokens,
            shared_tokens=None if prefix is None else prefix.shared_tokens,
            block_tokens=None if prefix is None else prefix.block_tokens,
            over_ms=over_ms,
            added_ms=added,
        )
        return self._never(view, prompt_tokens, ttft)


@dataclass
class RouterContext:
    """Cluster configuration, predictors and per-model step-time models.

    ``lam_per_usd``: paper A's λ, utility given up per USD (0: cost only through the
    budget). ``ttft``: defaults to ``SfsTtft`` over ``step_time``. ``report_ttft``:
    latency-blind policies still fill ``predicted_ttft_ms`` (one in-order SFS run per
    used instance) unless this is False, e.g. in a simulator that measures it anyway.
    ``prefix_aware``: TTFT estimates count each query's prefix-cache hits on each instance
    (``routing.prefix``; the views' ``prefix_hashes``); False: every prompt is prefilled in
    full, as if no instance cached anything.
    """

    cluster: ClusterConfig
    quality: QualityModel
    length: LengthModel | None = None
    step_time: Mapping[str, StepTimeModel] = field(default_factory=dict)
    ttft: TtftModel | None = None
    lam_per_usd: float = 0.0
    report_ttft: bool = True  # False: latency-blind policies skip the SFS TTFT they report
    prefix_aware: bool = True
    # each cluster model's name in the predictors (``ModelSpec.quality_as``, else its own)
    predictor_keys: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.predictor_keys = {m.name: m.predictor_key for m in self.cluster.models}
        if not math.isfinite(self.lam_per_usd) or self.lam_per_usd < 0:
            raise ValueError(f"lam_per_usd must be a finite number >= 0, got {self.lam_per_usd}")
        known = set(self.quality.models)
        missing = [m.name for m in self.cluster.models if m.predictor_key not in known]
        if missing:
            raise ValueError(
                f"the quality predictor has no column for models {missing}; "
                f"it knows {sorted(known)}: retrain it, or name the column each model is "
                "read from with `quality_as` in the cluster config"
            )
        if self.ttft is None:
            self.ttft = SfsTtft(self.cluster, self.step_time)

    @property
    def ttft_model(self) -> TtftModel:
        assert self.ttft is not None
        return self.ttft

    @classmethod
    def build(
        cls,
        cluster: ClusterConfig,
        quality: QualityModel,
        length: LengthModel | None = None,
        step_time: Mapping[str, StepTimeModel] | None = None,
        lam_per_usd: float = 0.0,
        report_ttft: bool = True,
        prefix_aware: bool = True,
        profiles: Profiles | None = None,
    ) -> RouterContext:
        """Fill missing step-time models from each ModelSpec's coefficients or profile
        (looked up in ``profiles``, which the caller read: ``loaders.profiles.profiles_for``)."""
        models: dict[str, StepTimeModel] = dict(step_time or {})
        for spec in cluster.models:
            if spec.name in models:
                continue
            if spec.step_time is not None:
                models[spec.name] = StepTimeModel.from_coefficients(spec.step_time)
            elif spec.profile is not None:
                if profiles is None:
                    raise ValueError(
                        f"model {spec.name!r} names step-time profile {spec.profile!r} but no "
                        "profiles were given (read them with loaders.profiles.profiles_for)"
                    )
                models[spec.name] = profiles.model(spec.profile)
        return cls(cluster, quality, length, models, None, lam_per_usd, report_ttft, prefix_aware)
