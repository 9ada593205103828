"""Instance liveness in Redis: workers write heartbeats (with a TTL), residents and their
token progress, and the online step-time coefficients; routers read every instance's
snapshot (and the step times) in one pipelined round trip. See ``state.protocols``:
``LivenessWriter``, ``LivenessReader``, ``StepTimePublisher``."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis

from schemas import FinishedRequest, InstanceSnapshot, ResidentRequest, StepTimeCoefficients
from state.keys import Keys
from state.records import InstanceLive, LiveStepTime
from state.redis_core import RedisCore, _count, _fraction, _seconds_ms

RESIDENTS_KEEP_S = 600.0  # residents of a worker that stopped writing vanish after this
TOMBSTONE_KEEP_S = 3600.0  # a done resident is not re-added by a resync for this long
# Requests that left an instance, kept for the routers' catch-up (``routing.sfs.catch_up``):
# at most this many, newest first, and none older than FINISHED_KEEP_S (the list expires that
# long after its last write; a router reads only those that left within it). The catch-up
# replays those that left since the oldest resident arrived: at 15 requests/s, 32 cover 2 s.
FINISHED_KEEP = 32
FINISHED_KEEP_S = 10.0


class RedisLiveness(RedisCore):
    """Heartbeats, residents, snapshots and step-time records."""

    def __init__(self, client: aioredis.Redis, keys: Keys, display_url: str) -> None:
        super().__init__(client, keys, display_url)
        self._snap_cache: dict[str, dict[str, tuple[str, ResidentRequest]]] = {}
        self._fin_cache: dict[str, tuple[str, list[FinishedRequest]]] = {}

    async def heartbeat(
        self,
        instance_id: str,
        model: str,
        ttl_s: float,
        max_concurrency: int,
        *,
        engine_running: int | None = None,
        engine_waiting: int | None = None,
        engine_kv_usage: float | None = None,
        now: float | None = None,
    ) -> None:
        """Mark the instance alive for ``ttl_s``; refresh its residents and their slots' leases."""
        ttl_ms = _seconds_ms(ttl_s, "heartbeat ttl_s")
        _count(max_concurrency, "max_concurrency")
        keep_ms = _seconds_ms(max(RESIDENTS_KEEP_S, 10 * ttl_s), "residents keep")
        k = self.keys
        await self._script(
            "heartbeat",
            [k.heartbeat(instance_id), k.residents(instance_id), k.slots(instance_id)],
            [
                model,
                max_concurrency,
                repr(time.time() if now is None else now),
                ttl_ms,
                keep_ms,
                "" if engine_running is None else _count(engine_running, "engine_running"),
                "" if engine_waiting is None else _count(engine_waiting, "engine_waiting"),
                ""
                if engine_kv_usage is None
                else repr(_fraction(engine_kv_usage, "engine_kv_usage")),
            ],
        )

    async def resident_add(
        self, instance_id: str, r: ResidentRequest, *, now: float | None = None
    ) -> None:
        k = self.keys
        await self._script(
            "resident_add",
            [
                k.heartbeat(instance_id),
                k.residents(instance_id),
                k.slots(instance_id),
                k.gone(instance_id),
            ],
            [
                r.query_id,
                _encode_resident(r),
                repr(time.time() if now is None else now),
                int(RESIDENTS_KEEP_S * 1000),
            ],
        )

    async def resident_progress(
        self,
        instance_id: str,
        query_id: str,
        prefilled_tokens: int,
        decoded_tokens: int,
        *,
        now: float | None = None,
    ) -> None:
        """Update token counts; a no-op when the resident is gone (``resident_done`` won a race)."""
        k = self.keys
        await self._script(
            "resident_progress",
            [k.heartbeat(instance_id), k.residents(instance_id)],
            [
                k.check_query_id(query_id),
                _count(prefilled_tokens, "prefilled_tokens"),
                _count(decoded_tokens, "decoded_tokens"),
                repr(time.time() if now is None else now),
            ],
        )

    async def resident_done(
        self, instance_id: str, query_id: str, *, now: float | None = None
    ) -> None:
        """Remove the resident and release its capacity slot. Idempotent."""
        k = self.keys
        await self._script(
            "resident_done",
            [
                k.heartbeat(instance_id),
                k.residents(instance_id),
                k.slots(instance_id),
                k.gone(instance_id),
            ],
            [
                k.check_query_id(query_id),
                repr(time.time() if now is None else now),
                repr(TOMBSTONE_KEEP_S),
            ],
        )

    async def residents_reconcile(self, instance_id: str, keep_query_ids: Sequence[str]) -> int:
        """Drop residents not in ``keep_query_ids`` (what the worker really runs); return how many."""
        ids = [self.keys.check_query_id(q) for q in keep_query_ids]
        return int(
            await self._script("residents_reconcile", [self.keys.residents(instance_id)], ids)
        )

    async def residents_sync(
        self,
        instance_id: str,
        residents: Sequence[ResidentRequest],
        *,
        view_at: float | None = None,
    ) -> int:
        """Make Redis hold the worker's own view of its residents (drift, Redis restarts).

        ``view_at``: when the view was taken. Residents done since then are not re-added
        (tombstones), and residents added since then (``arrived_at > view_at``) are not
        removed, so a resync never undoes a concurrent add or done. None: replace outright.
        Returns how many residents were dropped.
        """
        k = self.keys
        args: list[Any] = [
            "1e300" if view_at is None else repr(view_at),
            int(RESIDENTS_KEEP_S * 1000),
        ]
        for r in residents:
            args += [r.query_id, _encode_resident(r)]
        return int(
            await self._script(
                "residents_sync", [k.residents(instance_id), k.gone(instance_id)], args
            )
        )

    async def residents(self, instance_id: str) -> list[ResidentRequest]:
        """The instance's residents in arrival order (also for tests and the CLI)."""
        raw = await self._call("residents", self._r.hgetall(self.keys.residents(instance_id)))
        return _residents_of(cast(dict[str, str], raw))

    # ------------------------------------------------------------------ router reads

    async def snapshots(self, instance_ids: Sequence[str], now: float) -> dict[str, InstanceLive]:
        """Every instance's live state in one pipelined round trip."""
        live, _ = await self.snapshots_and_step_times(instance_ids, (), now)
        return live

    async def snapshots_and_step_times(
        self, instance_ids: Sequence[str], models: Sequence[str], now: float
    ) -> tuple[dict[str, InstanceLive], dict[str, LiveStepTime]]:
        """Every instance's live state, the online step-time coefficients of ``models``
        (those with a record), and each instance's prefix-cache model (``state.prefix``), in
        one pipelined round trip."""
        k = self.keys
        ids = list(dict.fromkeys(instance_ids))
        names = list(dict.fromkeys(models))
        replies = await self._script_many(
            "snapshot",
            [
                ([k.heartbeat(iid), k.residents(iid), k.slots(iid), k.finished(iid)], [])
                for iid in ids
            ],
            extra=[("HGETALL", k.step_time(m)) for m in names]
            + [("ZRANGE", k.prefix(iid)[0], "0", "-1") for iid in ids],
        )
        n_head = len(ids) + len(names)
        prefixes = {iid: _sorted_hashes(raw) for iid, raw in zip(ids, replies[n_head:], strict=True)}
        out: dict[str, InstanceLive] = {}
        heads = replies[: len(ids)]
        for iid, (hb_blob, res_blob, slots, fin_blob) in zip(ids, heads, strict=True):
            hb = _pairs(hb_blob)
            res = _pairs(res_blob)
            slots_used = int(slots)
            taken_at = _opt_float(hb.get("at")) if hb else None
            if not hb or taken_at is None:
                out[iid] = InstanceLive(
                    iid, None, slots_used, False, math.inf, prefix_hashes=prefixes[iid]
                )
                continue
            snap = InstanceSnapshot.model_construct(
                instance_id=iid,
                model=hb.get("model", ""),
                taken_at=taken_at,
                residents=self._residents_cached(iid, res),
                finished=self._finished_cached(iid, fin_blob, now),
                healthy=True,
                source="redis",
            )
            out[iid] = InstanceLive(
                iid,
                snap,
                slots_used,
                True,
                max(0.0, now - taken_at),
                max_concurrency=_opt_int(hb.get("max_concurrency")),
                engine_running=_opt_int(hb.get("engine_running")),
                engine_waiting=_opt_int(hb.get("engine_waiting")),
                engine_kv_usage=_opt_float(hb.get("engine_kv_usage")),
                prefix_hashes=prefixes[iid],
            )
        steps: dict[str, LiveStepTime] = {}
        for m, raw in zip(names, replies[len(ids) : n_head], strict=True):
            rec = _live_step_time(m, raw)
            if rec is not None:
                steps[m] = rec
        return out, steps

    def _residents_cached(self, instance_id: str, raw: Mapping[str, str]) -> list[ResidentRequest]:
        """Parse residents, reusing the (frozen) objects whose record did not change since the
        last snapshot: between two windows most residents are unchanged, and building a
        pydantic object costs more than the rest of the read."""
        prev = self._snap_cache.get(instance_id, {})
        cur: dict[str, tuple[str, ResidentRequest]] = {}
        for qid, text in raw.items():
            hit = prev.get(qid)
            if hit is not None and hit[0] == text:
                cur[qid] = hit
            elif (r := _decode_resident(qid, text)) is not None:
                cur[qid] = (text, r)
        self._snap_cache[instance_id] = cur
        rs = [r for _, r in cur.values()]
        rs.sort(key=lambda r: (r.arrived_at, r.query_id))
        return rs

    def _finished_cached(self, instance_id: str, blob: str, now: float) -> list[FinishedRequest]:
        """The instance's recently finished requests (newest first), those that left at
        most ``FINISHED_KEEP_S`` before ``now``; parsed once per change of the list."""
        hit = self._fin_cache.get(instance_id)
        if hit is None or hit[0] != blob:
            texts = blob.split("\0") if blob else []
            parsed = [f for t in texts if (f := _decode_finished(t)) is not None]
            hit = (blob, parsed)
            self._fin_cache[instance_id] = hit
        return [f for f in hit[1] if f.finished_at >= now - FINISHED_KEEP_S]

    # ------------------------------------------------------------------ dedupe

    async def step_time_publish(
        self,
        model: str,
        coefficients: StepTimeCoefficients,
        *,
        rows: int,
        instance_id: str,
        ttl_s: float,
        fit_mape: float | None = None,
        ttft_error: float | None = None,
        dispatch_ms: float | None = None,
        now: float | None = None,
    ) -> int:
        """Publish ``model``'s online-refitted Eq. 9 coefficients; returns their version.
        ``dispatch_ms``: the writer's estimate of the decision-to-engine delay, which routers
        add to each TTFT they predict. Without a new write for ``ttl_s`` the record expires
        (routers fall back to the configured coefficients and no dispatch delay)."""
        c = coefficients

        def opt(v: float | None) -> str:
            return "" if v is None or not math.isfinite(v) else repr(float(v))

        version = await self._script(
            "step_time",
            [self.keys.step_time(model)],
            [
                repr(c.c0_ms),
                repr(c.c1_ms_per_token),
                repr(c.c2_ms_per_ctx_token),
                repr(c.c3_ms_per_attn_unit),
                repr(time.time() if now is None else now),
                _count(rows, "rows"),
                opt(fit_mape),
                opt(ttft_error),
                self.keys.check_instance_id(instance_id),
                _seconds_ms(ttl_s, "step-time ttl_s"),
                "" if dispatch_ms is None or not dispatch_ms >= 0 else opt(dispatch_ms),
            ],
        )
        return int(version)

    async def instance_down(self, instance_id: str) -> None:
        """Drop the heartbeat now (a worker stopping cleanly): routers see it dead at once."""
        await self._call("instance_down", self._r.delete(self.keys.heartbeat(instance_id)))

    async def reset_instance(self, instance_id: str) -> None:
        """Forget an instance's residents (a worker restarting: its work is re-delivered by Kafka)."""
        await self._call("reset_instance", self._r.delete(self.keys.residents(instance_id)))


def _encode_resident(r: ResidentRequest) -> str:
    return f"{r.prompt_tokens},{r.prefilled_tokens},{r.decoded_tokens},{r.predicted_output_tokens},{r.arrived_at!r}"


def encode_finished(f: FinishedRequest) -> str:
    """A recently finished request as ``resident_done`` stores it."""
    return f"{f.prompt_tokens},{f.output_tokens},{f.arrived_at!r},{f.finished_at!r}"


def _decode_finished(text: str) -> FinishedRequest | None:
    """Parse one recently-finished record; a malformed one is skipped."""
    try:
        p, o, a, f = text.split(",")
        prompt, output = max(0, int(p)), max(1, int(o))
        arrived, finished = max(0.0, float(a)), float(f)
    except ValueError:
        return None
    if not (math.isfinite(arrived) and math.isfinite(finished)):
        return None
    return FinishedRequest.model_construct(
        prompt_tokens=prompt,
        output_tokens=output,
        arrived_at=arrived,
        finished_at=max(arrived, finished),
    )


def _decode_resident(query_id: str, text: str) -> ResidentRequest | None:
    """Parse one resident record; a malformed one is skipped rather than failing the snapshot."""
    try:
        p, f, d, o, a = text.split(",")
        prompt, prefilled, decoded = max(0, int(p)), max(0, int(f)), max(0, int(d))
        predicted, arrived = max(1, int(o)), max(0.0, float(a))
    except ValueError:
        return None
    prefilled = min(prefilled, prompt)
    if decoded > 0:
        prefilled = prompt
    # fields are sanitised above; skip pydantic validation on the router's hot path
    return ResidentRequest.model_construct(
        query_id=query_id,
        prompt_tokens=prompt,
        prefilled_tokens=prefilled,
        decoded_tokens=decoded,
        predicted_output_tokens=predicted,
        arrived_at=arrived,
    )


def _opt_int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def _opt_float(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def _live_step_time(model: str, raw: Mapping[str, str] | None) -> LiveStepTime | None:
    """A step-time record; None when missing or malformed (the configured ones apply)."""
    if not raw:
        return None
    try:
        coef = StepTimeCoefficients(
            c0_ms=float(raw["c0_ms"]),
            c1_ms_per_token=float(raw["c1_ms_per_token"]),
            c2_ms_per_ctx_token=float(raw["c2_ms_per_ctx_token"]),
            c3_ms_per_attn_unit=float(raw["c3_ms_per_attn_unit"]),
        )
        return LiveStepTime(
            model=model,
            coefficients=coef,
            version=int(raw.get("version", "0")),
            at=float(raw["at"]),
            rows=int(raw.get("rows", "0")),
            instance_id=str(raw.get("instance", "")),
            fit_mape=_opt_float(raw.get("fit_mape")),
            ttft_error=_opt_float(raw.get("ttft_error")),
            dispatch_ms=_opt_dispatch_ms(raw.get("dispatch_ms")),
        )
    except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def _opt_dispatch_ms(value: str | None) -> float | None:
    ms = _opt_float(value)
    return ms if ms is not None and ms >= 0 else None


def _pairs(blob: str) -> dict[str, str]:
    """``"k\0v\0k\0v"`` (a flattened HGETALL) → dict."""
    if not blob:
        return {}
    parts = blob.split("\0")
    return dict(zip(parts[::2], parts[1::2], strict=False))


def _residents_of(raw: Mapping[str, str]) -> list[ResidentRequest]:
    rs = [r for qid, text in raw.items() if (r := _decode_resident(qid, text)) is not None]
    rs.sort(key=lambda r: (r.arrived_at, r.query_id))
    return rs


def _sorted_hashes(members: Sequence[str] | None) -> npt.NDArray[np.uint64] | None:
    """A prefix model's members (decimal block hashes) as the sorted array the router's hit
    lookups take (``routing.prefix.WindowPrefixes.hit_tokens``); None when it has none."""
    if not members:
        return None
    out: npt.NDArray[np.uint64] = np.sort(np.array(members).astype(np.uint64))
    return out
