"""Replay timed requests into a real vLLM server and record what a router would have seen.

:func:`replay` sends each request to an OpenAI-compatible ``/v1/completions`` endpoint at its
arrival time (streaming, ``ignore_eos`` so output lengths are exact, prompts as token ids so
prompt lengths are exact, ``continuous_usage_stats`` so every chunk carries the tokens
generated so far) and returns one :class:`ReplayRecord` per request: its real TTFT (send to
first streamed token) and the instance snapshot at the moment it was sent, built the way a
worker builds it from its own streams: every request in flight on that server, with its
prompt, whether its first token has come back (prefilled), the tokens streamed so far and how
long ago it was sent (what the router reads from a resident's ``arrived_at``), and the
requests that finished recently (``finished``: what a worker publishes beside its residents,
bounded as it is: ``state.FINISHED_KEEP`` newest, within ``state.FINISHED_KEEP_S``).

:func:`evaluate` (pure) prices those snapshots with SFS (predicted and real output lengths),
runs the simulated engine on the same send times, and the throughput baseline, and gives the
MAPE of each against the measured TTFTs; :func:`server_ms_of` calibrates the server's own
time per request on lone requests. ``bench/real_vllm.py`` drives them.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.sfs import catch_up, later_arrivals, standalone_ttft_ms, with_conditional_lengths
from routing.steptime import StepTimeModel
from routing.throughput_baseline import prefill_tokens_per_s, throughput_ttft_ms
from routing.types import InstanceState, RecentFinished
from schemas import SchedulerConfig
from state import FINISHED_KEEP, FINISHED_KEEP_S
from wiring.sse import SSEParser, interpret

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ReplayRequest:
    request_id: str
    arrival_s: float  # relative to the replay's start
    prompt_tokens: int
    output_tokens: int


@dataclass
class ReplayRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    sent_s: float = 0.0  # relative to the replay's start
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    generated_tokens: int = 0
    error: str = ""
    # the snapshot at send: per resident [prompt, prefilled, decoded, real output length,
    # ms since it was sent]
    residents: list[list[float]] = field(default_factory=list)
    # requests finished before the send, newest first, as a worker publishes them (at most
    # FINISHED_KEEP, within FINISHED_KEEP_S): [prompt, output tokens, ms since it was sent,
    # ms since it finished]; None: not recorded (records of an older bench)
    finished: list[list[float]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _InFlight:
    prompt: int
    output: int
    sent: float = 0.0
    first: bool = False
    decoded: int = 0


async def replay(
    endpoint: str,
    model: str,
    requests: list[ReplayRequest],
    *,
    vocab_size: int = 8192,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> list[ReplayRecord]:
    """Send ``requests`` at their arrival times to ``endpoint``; one record each, in order."""
    import httpx

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(10, vocab_size - 10) for _ in range(r.prompt_tokens)] for r in requests
    ]
    inflight: dict[str, _InFlight] = {}
    done: list[tuple[float, float, int, int]] = []  # (finished, sent, prompt, output), in order
    records = [
        ReplayRecord(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests
    ]
    url = endpoint.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        t0 = time.monotonic()

        async def one(i: int) -> None:
            r, rec = requests[i], records[i]
            delay = t0 + r.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            rec.residents = [
                [f.prompt, f.prompt if f.first else 0, f.decoded, f.output, (now - f.sent) * 1e3]
                for f in inflight.values()
            ]
            rec.finished = [
                [p, o, (now - s) * 1e3, (now - e) * 1e3]
                for e, s, p, o in reversed(done[max(0, len(done) - FINISHED_KEEP) :])
                if now - e <= FINISHED_KEEP_S
            ]
            me = inflight[r.request_id] = _InFlight(r.prompt_tokens, r.output_tokens, now)
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": r.output_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "temperature": 0.0,
            }
            sent = me.sent = time.monotonic()
            rec.sent_s = sent - t0
            try:
                async with client.stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                        return
                    parser = SSEParser()
                    async for text in resp.aiter_text():
                        for payload in parser.feed(text):
                            chunk = interpret(payload, chat=False)
                            if chunk.error:
                                raise ValueError(chunk.error)
                            n = int((chunk.usage or {}).get("completion_tokens") or 0)
                            if n >= 1 and not me.first:
                                me.first = True
                                rec.ttft_s = time.monotonic() - sent
                            me.decoded = max(me.decoded, n)
                ended = time.monotonic()
                rec.e2e_s = ended - sent
                rec.generated_tokens = me.decoded
                if me.decoded >= 1:
                    done.append((ended, sent, r.prompt_tokens, me.decoded))
            except (httpx.HTTPError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
            finally:
                inflight.pop(r.request_id, None)

        await asyncio.gather(*(one(i) for i in range(len(requests))))
    return records


def measure_capacity(
    endpoint: str, model: str, requests: list[ReplayRequest], *, vocab_size: int = 8192
) -> float:
    """Completed requests per second when all of ``requests`` arrive at once (saturation)."""
    burst = [ReplayRequest(r.request_id, 0.0, r.prompt_tokens, r.output_tokens) for r in requests]
    t0 = time.monotonic()
    recs = asyncio.run(replay(endpoint, model, burst, vocab_size=vocab_size, seed=1))
    span = time.monotonic() - t0
    bad = [r for r in recs if r.error]
    if bad:
        raise RuntimeError(f"capacity run: {len(bad)} request(s) failed, first: {bad[0].error}")
    return len(recs) / span


# ---- evaluation (pure) -----------------------------------------------------------------------


def _state(residents: list[list[float]], predicted: int | None) -> InstanceState:
    if not residents:
        return InstanceState.empty()
    a = np.asarray([r[:4] for r in residents], dtype=np.int64)
    out = a[:, 3] if predicted is None else np.full(a.shape[0], predicted, dtype=np.int64)
    return InstanceState(a[:, 0], a[:, 1], a[:, 2], np.maximum(out, a[:, 2] + 1))


def _waited_ms(residents: list[list[float]]) -> FloatArray:
    """Each resident's time at the engine when the snapshot was taken (0 where the record
    predates that column)."""
    return np.asarray([r[4] if len(r) > 4 else 0.0 for r in residents], dtype=np.float64)


def _finished(rec: ReplayRecord, ok: list[ReplayRecord]) -> RecentFinished:
    """The requests finished before ``rec`` was sent, as its record has them, or (records of
    an older bench) as the level's records give them, bounded the same way."""
    rows = rec.finished
    if rows is None:
        ends = sorted(
            ((r.sent_s + r.e2e_s, r) for r in ok if r.sent_s + r.e2e_s <= rec.sent_s),
            key=lambda x: x[0],
        )
        rows = [
            [r.prompt_tokens, r.generated_tokens, (rec.sent_s - r.sent_s) * 1e3,
             (rec.sent_s - e) * 1e3]
            for e, r in reversed(ends[max(0, len(ends) - FINISHED_KEEP) :])
            if rec.sent_s - e <= FINISHED_KEEP_S and r.generated_tokens >= 1
        ]  # fmt: skip
    return RecentFinished.of(np.asarray([x[:4] for x in rows], dtype=np.float64).reshape(-1, 4))


def server_ms_of(records: list[ReplayRecord], model: StepTimeModel) -> float:
    """The server's own time per request outside engine steps (API process, IPC to the engine
    core, detokenising, streaming; and what the step-time model misses on a lone prefill):
    the median of ``TTFT - Eq. 9 prefill`` over requests sent to an idle server. Calibrate
    it on requests of their own, not on the ones it is scored on."""
    gaps = [
        r.ttft_s * 1e3 - float(model.prefill_ms(r.prompt_tokens))
        for r in records
        if not r.error and np.isfinite(r.ttft_s) and not r.residents
    ]
    if not gaps:
        raise ValueError("server_ms_of: no request was sent to an idle server")
    return float(np.median(gaps))


def evaluate(
    records: list[ReplayRecord],
    model: StepTimeModel,
    sched: SchedulerConfig,
    *,
    engine_timing: Any = None,
    server_ms: float = 0.0,
    default_output_tokens: int = 64,
) -> dict[str, Any]:
    """MAPE against the measured TTFTs of every estimator, each on the snapshot a worker would
    have reported at the send (or, for the simulated engine, the same send times):

    * ``sfs_plain``: SFS on the snapshot as the stream shows it (a request without its first
      token not prefilled at all), predicted output lengths (the mean output of requests
      finished before the send), nothing outside engine steps: SFS before issue 18;
    * ``sfs_predicted``: SFS as the router runs it on a real vLLM: the snapshot caught up to
      the moment of sending (``routing.sfs.catch_up``: prefill done since each resident
      arrived, with the requests that finished meanwhile, the step in flight) plus
      ``server_ms`` (:func:`server_ms_of`), predicted output lengths: each resident routed
      with the mean output of the requests finished before the send, then, as the router
      does, each decoding one's conditioned on what it has decoded over the recently
      finished requests' lengths (``routing.sfs.with_conditional_lengths``);
      ``sfs_predicted_flat``: the same without that conditioning (every resident the one
      mean, at least its decoded tokens + 1: the router before it); ``sfs_real_lengths``:
      the same with the real output lengths;
    * ``sfs_residents_predicted`` / ``sfs_residents_real_lengths``: the same, the catch-up
      replaying the residents only (before the finished requests were published), flat
      predicted lengths;
    * ``sfs_later_predicted`` / ``sfs_later_predicted_flat`` / ``sfs_later_real_lengths``:
      ``sfs_predicted`` / ``sfs_predicted_flat`` / ``sfs_real_lengths`` with the requests
      expected after the candidate priced in its last prefill step
      (``routing.sfs.LaterArrivals``, the rate of the snapshot's last second);
    * ``sim_engine``: the simulated engine (``engine_timing``: a ``sim.timing`` source) run on
      the same send times, plus ``server_ms``;
    * ``throughput_baseline``: queued prompt tokens over the engine's prefill throughput.
    """
    from sim.engine import SimEngine

    ok = [r for r in records if not r.error and np.isfinite(r.ttft_s)]
    if not ok:
        raise ValueError("no request finished without an error")
    real = np.array([r.ttft_s * 1e3 for r in ok])
    tput = prefill_tokens_per_s(model, sched)
    plain, sfs_pred, sfs_real, thr, res_pred, res_real, lat_pred, lat_real = (
        np.zeros(len(ok)) for _ in range(8)
    )
    sfs_flat, lat_flat = np.zeros(len(ok)), np.zeros(len(ok))
    done_sorted = sorted((r.sent_s + r.e2e_s, r.generated_tokens) for r in ok)
    for i, r in enumerate(ok):
        fin = [g for t, g in done_sorted if t <= r.sent_s]
        pred = round(float(np.mean(fin))) if fin else default_output_tokens
        p = np.array([r.prompt_tokens], dtype=np.int64)
        waited = _waited_ms(r.residents)
        predicted, real_len = _state(r.residents, pred), _state(r.residents, None)
        plain[i] = standalone_ttft_ms(predicted, p, model, sched)[0]
        recent = _finished(r, ok)
        later = later_arrivals(real_len, waited, recent)
        for dest, st0, done, nxt, cond in (
            (sfs_pred, predicted, recent, None, True),
            (sfs_flat, predicted, recent, None, False),
            (sfs_real, real_len, recent, None, False),
            (res_pred, predicted, None, None, False),
            (res_real, real_len, None, None, False),
            (lat_pred, predicted, recent, later, True),
            (lat_flat, predicted, recent, later, False),
            (lat_real, real_len, recent, later, False),
        ):
            st, delay = catch_up(st0, waited, model, sched, done)
            if cond:  # as the router does: conditional on what each resident decoded
                st = with_conditional_lengths(st, recent)
            dest[i] = server_ms + float(
                standalone_ttft_ms(st, p, model, sched, start_delay_ms=delay, later=nxt)[0]
            )
        thr[i] = throughput_ttft_ms(real_len, p, tput)[0]
    out: dict[str, Any] = {"n": len(ok), "errors": len(records) - len(ok), "server_ms": server_ms}
    est = {
        "sfs_plain": plain,
        "sfs_predicted": sfs_pred,
        "sfs_predicted_flat": sfs_flat,
        "sfs_real_lengths": sfs_real,
        "sfs_residents_predicted": res_pred,
        "sfs_residents_real_lengths": res_real,
        "sfs_later_predicted": lat_pred,
        "sfs_later_predicted_flat": lat_flat,
        "sfs_later_real_lengths": lat_real,
        "throughput_baseline": thr,
    }
    if engine_timing is not None:
        eng = SimEngine(engine_timing, sched, 0)
        order = sorted(range(len(ok)), key=lambda k: ok[k].sent_s)
        for k in order:
            r = ok[k]
            eng.advance_to(r.sent_s)
            eng.submit(str(k), r.sent_s, r.prompt_tokens, r.output_tokens, r.output_tokens)
        eng.run_until_idle()
        sim = np.zeros(len(ok))
        for f in eng.finished:
            sim[int(f.request_id)] = f.ttft_s * 1e3
        est["sim_engine"] = sim + server_ms
    for name, v in est.items():
        ape = np.abs(v - real) / real
        out[f"mape_{name}"] = round(float(np.mean(ape)), 4)
        out[f"p50_ape_{name}"] = round(float(np.median(ape)), 4)
        out[f"mean_ms_{name}"] = round(float(v.mean()), 1)
    out["mean_ms_real"] = round(float(real.mean()), 1)
    out["p50_ms_real"] = round(float(np.median(real)), 1)
    return out
