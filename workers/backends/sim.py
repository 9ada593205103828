"""Backend running the simulated engine in-process, in wall-clock time (no HTTP).

The same ``RealtimeEngine`` that ``switchyard fake-vllm`` serves; output lengths and text
from ``workers.synth`` (``max_tokens`` when the query sets it, else a seeded draw). The
engine's executed steps are available for online step-time recalibration.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from schemas import ModelSpec
from workers import synth
from workers.backends.base import EngineLoad, Generation, GenerationRequest, ProgressFn
from workers.realtime import RealtimeEngine, timing_for_model

if TYPE_CHECKING:
    from sim.engine import StepLog


class SimBackend:
    name = "sim"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        instance_id: str,
        time_scale: float = 1.0,
        seed: int = 0,
        noise_sigma: float = 0.0,
    ) -> None:
        self.spec = spec
        self.engine = RealtimeEngine(
            timing_for_model(spec, noise_sigma),
            spec.scheduler,
            time_scale=time_scale,
            seed=seed,
            instance_id=instance_id,
            model=spec.name,
            record_steps=True,
            max_model_len=spec.max_model_len,
        )

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.stop()

    async def model_problem(self) -> str | None:
        return None  # the engine runs in-process, on this model

    async def engine_load(self) -> EngineLoad:
        return EngineLoad(
            running=self.engine.n_running,
            waiting=self.engine.n_waiting,
            kv_usage=self.engine.kv_usage(),
        )

    def drain_steps(self) -> StepLog:
        """Engine steps executed since the last call (reported for step-time recalibration)."""
        return self.engine.drain_step_log()

    async def generate(self, req: GenerationRequest, on_progress: ProgressFn) -> Generation:
        q = req.query
        seed_text = f"{q.seed}\x1f{q.text()}" if q.seed is not None else q.text()
        cap = self.spec.output_cap_tokens(q, req.prompt_tokens)
        n_out = synth.output_tokens(
            q.output_cap_tokens(), seed_text, self.spec.mean_output_tokens or 128.0, cap_tokens=cap
        )
        sent_at = time.time()
        first: float | None = None
        tokens = 0
        try:
            stream = self.engine.submit(
                req.prompt_tokens, n_out, req.predicted_output_tokens, request_id=req.request_id
            )
            async for ev in stream:
                if ev.kind == "prefill":
                    on_progress(ev.prefilled_tokens, 0)
                    continue
                if first is None and ev.tokens > 0:
                    first = ev.wall_s
                if req.on_text is not None and ev.tokens > tokens:
                    req.on_text(synth.tokens_text(seed_text, tokens, ev.tokens))
                tokens = ev.tokens
                on_progress(ev.prefilled_tokens, ev.tokens)
        except (RuntimeError, ValueError) as exc:
            return Generation(
                "",
                req.prompt_tokens,
                tokens,
                sent_at,
                first,
                time.time(),
                error=f"simulated engine: {exc}",
            )
        return Generation(
            text=synth.tokens_text(seed_text, 0, tokens),
            prompt_tokens=req.prompt_tokens,
            output_tokens=tokens,
            sent_at=sent_at,
            first_token_at=first,
            finished_at=time.time(),
            usage_reported=True,
            finish_reason="length" if tokens >= cap else "stop",
        )
