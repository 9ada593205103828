"""Online recalibration of Eq. 9 on a REAL vLLM server (issue 18 item 5): the live SFS TTFT
error over time, starting from a wrong profile, beside an offline-fitted one.

    .venv/bin/python bench/online_steptime.py [--minutes 5] [--out F]

Starts one real vLLM server (instance ``wide-0`` of configs/clusters/real-vllm-cpu.yaml,
``switchyard.vllm_servers``) and sends it Poisson arrivals (``--rate`` per second) with
prompt and output lengths from the vendored Azure LLM 2023 conv trace (x ``--prompt-scale``,
x ``--output-scale``, capped to fit the model), prompts as token ids and ``ignore_eos`` so
lengths are exact. The client is what a worker is: it keeps the in-flight requests it sent
(tokens streamed so far) and feeds ``workers.steptime_feed.StepTimeFeed`` exactly as the
worker does (sent / every streamed chunk / finished; a refit every ``--refit-s``), the feed
starting from ``--prior`` (default: the H100 Llama-2-7B profile, far off a CPU).

At each send, SFS (``routing.sfs.estimate_ttft_ms``) on the same snapshot predicts the
request's TTFT with three models: the feed's current coefficients (``online``), the
offline-fitted profile (``--offline``: a profile name or ``c0,c1,c2,c3``), and the prior
unchanged. Output lengths given to SFS are the real ones (oracle), so only the step-time
model differs between the three. Prints one JSON object: MAPE of each per ``--bucket-s`` of
send time, and overall after the first ``--settle-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.profiles import load_profile  # noqa: E402
from routing.sfs import estimate_ttft_ms  # noqa: E402
from routing.steptime import StepTimeModel  # noqa: E402
from schemas import ClusterConfig  # noqa: E402
from sim.traffic import load_trace  # noqa: E402
from switchyard import vllm_servers  # noqa: E402
from wiring.paths import vendored_data  # noqa: E402
from wiring.sse import SSEParser, interpret  # noqa: E402
from workers.realtime import parse_coefficients  # noqa: E402
from workers.steptime_feed import StepTimeFeed  # noqa: E402

INSTANCE = "wide-0"


@dataclass
class Record:
    qid: str
    sent_s: float  # from the start of the run
    prompt: int
    output: int
    pred_ms: dict[str, float]
    ttft_ms: float | None = None
    error: str | None = None


def _model(text: str) -> tuple[StepTimeModel, str]:
    if "," in text:
        return StepTimeModel.from_coefficients(parse_coefficients(text)), f"coefficients {text}"
    return load_profile(text), f"profile {text}"


async def _one(
    http: httpx.AsyncClient, model_name: str, rec: Record, tokens: list[int], feed: StepTimeFeed,
    t0: float,
) -> None:  # fmt: skip
    body = {
        "model": model_name, "prompt": tokens, "max_tokens": rec.output, "stream": True,
        "ignore_eos": True, "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    sent = time.time()
    first: float | None = None
    decoded = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            parser = SSEParser()
            async for text in resp.aiter_text():
                for payload in parser.feed(text):
                    chunk = interpret(payload, chat=False)
                    if chunk.error:
                        rec.error = chunk.error
                        return
                    usage = chunk.usage or {}
                    # vLLM's continuous usage counts tokens; a server without it: one per chunk
                    n = int(usage.get("completion_tokens") or (decoded + int(bool(chunk.text))))
                    if n > decoded:
                        now = time.time()
                        if first is None:
                            first = now
                        decoded = n
                        feed.progress(rec.qid, decoded, now)
    except httpx.HTTPError as exc:
        rec.error = repr(exc)
    finally:
        ttft = None if first is None or rec.error else (first - sent) * 1000.0
        rec.ttft_ms = ttft
        feed.finished(rec.qid, ttft, first)


async def run(args: argparse.Namespace, endpoint: str, spec: Any) -> dict[str, Any]:
    prior, prior_src = _model(args.prior)
    offline, offline_src = _model(args.offline)
    sched = spec.scheduler
    feed = StepTimeFeed(prior, sched)
    trace = load_trace(vendored_data("profiles", "traces", "azure_llm_2023_conv_first4000.csv.gz"))
    rng = np.random.default_rng(args.seed)
    max_out = min(spec.max_output_tokens or 256, args.max_output)
    n_total = int(args.minutes * 60 * args.rate) + 1
    idx = rng.integers(0, len(trace.input_tokens), n_total)
    outs = np.clip(np.round(trace.output_tokens[idx] * args.output_scale), 1, max_out).astype(int)
    prompts = np.clip(
        np.round(trace.input_tokens[idx] * args.prompt_scale), 8, spec.max_model_len - outs - 8
    ).astype(int)
    gaps = rng.exponential(1.0 / args.rate, n_total)
    records: list[Record] = []
    tasks: list[asyncio.Task[None]] = []
    refits: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(600.0, connect=10.0)
    t0 = time.time()
    next_refit = args.refit_s
    async with httpx.AsyncClient(base_url=endpoint, limits=limits, timeout=timeout) as http:
        t_next = 0.0
        for i in range(n_total):
            t_next += float(gaps[i])
            while True:
                now = time.time() - t0
                if now >= next_refit:  # the worker's heartbeat-loop refit
                    fit = feed.refit()
                    refits.append({
                        "t_s": round(now, 1), "rows": fit.n_rows,
                        "coef": [float(f"{c:.6g}") for c in fit.model.coef],
                        "fit_mape": None if not np.isfinite(fit.mape) else round(fit.mape, 4),
                    })  # fmt: skip
                    next_refit += args.refit_s
                wait = min(t_next, next_refit) - now
                if wait <= 0 and now >= t_next:
                    break
                await asyncio.sleep(max(wait, 0.0))
            p, o = int(prompts[i]), int(outs[i])
            state = feed.state()
            pred = {
                name: float(
                    estimate_ttft_ms(state, np.array([p]), m, sched, output_tokens=np.array([o]))[0]
                )
                for name, m in (("online", feed.model), ("offline", offline), ("prior", prior))
            }
            rec = Record(f"r{i}", time.time() - t0, p, o, pred)
            records.append(rec)
            feed.sent(rec.qid, p, o, time.time())
            tokens = rng.integers(10, 8000, p).tolist()
            tasks.append(asyncio.create_task(_one(http, spec.name, rec, tokens, feed, t0)))
        await asyncio.gather(*tasks)
    return summarise(args, records, refits, feed, prior_src, offline_src)


def summarise(
    args: argparse.Namespace, records: list[Record], refits: list[dict[str, Any]],
    feed: StepTimeFeed, prior_src: str, offline_src: str,
) -> dict[str, Any]:  # fmt: skip
    ok = [r for r in records if r.ttft_ms is not None and r.ttft_ms > 0]

    def mape(rs: list[Record], name: str) -> float | None:
        if not rs:
            return None
        return round(
            float(np.mean([abs(r.pred_ms[name] - r.ttft_ms) / r.ttft_ms for r in rs])),
            4,  # type: ignore[operator]
        )

    buckets = []
    end = max((r.sent_s for r in ok), default=0.0)
    b = 0.0
    while b <= end:
        rs = [r for r in ok if b <= r.sent_s < b + args.bucket_s]
        buckets.append({
            "from_s": b, "n": len(rs),
            **{name: mape(rs, name) for name in ("online", "offline", "prior")},
            "median_ttft_ms": round(float(np.median([r.ttft_ms for r in rs])), 1) if rs else None,
        })  # fmt: skip
        b += args.bucket_s
    late = [r for r in ok if r.sent_s >= args.settle_s]
    return {
        "prior": prior_src,
        "offline": offline_src,
        "requests": len(records),
        "errors": sum(r.error is not None for r in records),
        "rows": dict(feed.rows),
        "mean_prompt_tokens": round(float(np.mean([r.prompt for r in records])), 1),
        "mean_output_tokens": round(float(np.mean([r.output for r in records])), 1),
        "buckets": buckets,
        f"after_{int(args.settle_s)}s": {n: mape(late, n) for n in ("online", "offline", "prior")},
        "refits": refits,
        "final_online": [float(f"{c:.6g}") for c in feed.model.coef],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    ap.add_argument("--prior", default="llama-2-7b-hf@h100")
    ap.add_argument("--offline", default=None, help="profile name or c0,c1,c2,c3 (default: "
                    "the instance's model profile in the cluster config)")  # fmt: skip
    ap.add_argument("--prompt-scale", type=float, default=0.125)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--refit-s", type=float, default=5.0)
    ap.add_argument("--bucket-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster", type=Path, default=vllm_servers.DEFAULT_CLUSTER)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--endpoint", default=None, help="use this running server (a dry run "
                    "against fake-vllm, say) instead of starting a real one")  # fmt: skip
    args = ap.parse_args()
    cluster = ClusterConfig.from_file(args.cluster)
    inst = next(i for i in cluster.instances if i.id == INSTANCE)
    spec = cluster.model(inst.model)
    if args.offline is None:
        if spec.profile is None:
            raise SystemExit(f"{spec.name} has no profile: pass --offline NAME or c0,c1,c2,c3")
        args.offline = spec.profile
    one = cluster.model_copy(update={"instances": [inst]})
    home = Path(tempfile.mkdtemp(prefix="online-steptime-"))
    la0 = [round(v, 2) for v in os.getloadavg()]
    t_start = time.time()
    if args.endpoint:
        result = asyncio.run(run(args, args.endpoint, spec))
        result["server"] = args.endpoint
    else:
        servers = vllm_servers.vllm_up(one, home=home, free_ports=True)
        try:
            result = asyncio.run(run(args, servers[0].address, spec))
        finally:
            vllm_servers.vllm_down(home)
        result["server_ready_s"] = servers[0].extra.get("ready_s")
    result["load_average_start"] = la0
    result["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    result["wall_s"] = round(time.time() - t_start, 1)
    result["settings"] = {k: str(v) for k, v in vars(args).items() if k != "out"}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
