"""Live TTFT validation on a REAL vLLM server: SFS, the simulated engine and the throughput
baseline against measured TTFTs (issue 18 item 4).

    nice -n -10 .venv/bin/python bench/real_vllm.py --out run1.json   # x3
    .venv/bin/python bench/real_vllm.py --summarise run1.json,run2.json,run3.json

Starts one real vLLM server (instance ``wide-0`` of configs/clusters/real-vllm-cpu.yaml,
``switchyard.vllm_servers``), then per trace (Azure LLM 2023 conv and code, vendored first
4,000 rows; prompt lengths x ``--prompt-scale``, output lengths x ``--output-scale`` capped at
the model's ``max_output_tokens``, so they fit its ``max_model_len``):

1. capacity: ``--burst`` requests sent at once, completed requests per second;
2. calibration, on requests of its own (trace rows from 2,000 on, never scored):
   ``--calib`` lone requests one after another (one client, 2 output tokens each, spaced
   so each finds the server idle); the server's own time per request outside
   engine steps is the median of their TTFT minus their Eq. 9 prefill
   (``offline.vllm_replay.server_ms_of``), what a worker publishes as ``server_ms``;
3. per load level (30/60/90% of that capacity): ``--n`` requests whose arrival times are the
   trace's own, rescaled to the level's rate, sent DIRECTLY to the server
   (``offline.vllm_replay.replay``); each request's TTFT (send to first streamed token) and
   the snapshot a worker would have reported when it was sent (requests in flight, prefilled
   or not, tokens streamed so far, time since sent);
4. ``offline.vllm_replay.evaluate``: SFS as before issue 18 (``sfs_plain``), SFS as the
   router now runs it on a real vLLM (snapshot caught up to the send, step in flight,
   ``server_ms``; predicted output lengths conditioned on what each resident has decoded,
   as the router does, the one-mean prediction it used before (``*_flat``), and the real
   output lengths), the simulated engine on the same send times, the throughput rule.

Prints one JSON object (and writes it to ``--out``) with MAPE per trace and load level;
``--summarise`` prints the median of several such files as a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.profiles import load_profile, read_profiles  # noqa: E402
from offline.vllm_replay import (  # noqa: E402
    ReplayRequest,
    evaluate,
    measure_capacity,
    replay,
    server_ms_of,
)
from schemas import ClusterConfig  # noqa: E402
from sim.timing import TableTiming  # noqa: E402
from sim.traffic import load_trace  # noqa: E402
from switchyard import vllm_model, vllm_servers  # noqa: E402
from wiring.paths import vendored_data  # noqa: E402

INSTANCE = "wide-0"
LEVELS = (0.3, 0.6, 0.9)


def requests_of(
    trace: str, n: int, prompt_scale: float, output_scale: float, max_out: int, max_len: int,
    offset: int = 0,
) -> tuple[list[ReplayRequest], np.ndarray]:  # fmt: skip
    t = load_trace(vendored_data("profiles", "traces", f"azure_llm_2023_{trace}_first4000.csv.gz"))
    sl = slice(offset, offset + n)
    out = np.clip(np.round(t.output_tokens[sl] * output_scale), 1, max_out).astype(int)
    cap = max_len - out - 8
    prompt = np.clip(np.round(t.input_tokens[sl] * prompt_scale), 8, cap).astype(int)
    arr = t.arrival_s[sl] - t.arrival_s[sl][0]
    reqs = [
        ReplayRequest(f"{trace}-{offset + i}", float(arr[i]), int(prompt[i]), int(out[i]))
        for i in range(len(prompt))
    ]
    return reqs, arr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per level")
    ap.add_argument("--n", type=int, default=60, help="requests per load level")
    ap.add_argument("--burst", type=int, default=32, help="requests in the capacity burst")
    ap.add_argument("--prompt-scale", type=float, default=0.125)
    ap.add_argument("--output-scale", type=float, default=0.25)
    ap.add_argument("--traces", default="conv,code")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep-records", type=Path, default=None, help="write per-request records")
    ap.add_argument("--calib", type=int, default=16, help="lone calibration requests per trace")
    ap.add_argument(
        "--shape",
        default="tiny",
        choices=sorted(vllm_model.SHAPES),
        help="the served Qwen3 shape; not tiny: profile qwen3-<shape>@cpu, a 1 GiB KV cache",
    )
    ap.add_argument("--calib-gap-s", type=float, default=0.15)
    ap.add_argument("--summarise", default=None, help="comma-separated --out files: median table")
    ap.add_argument(
        "--rescore",
        default=None,
        help="RUN.json,RECORDS.jsonl of an earlier run: score its records again with the "
        "current estimators and profile (server_ms from its calibration records) to --out",
    )
    args = ap.parse_args()
    if args.summarise:
        print(summarise([Path(f) for f in args.summarise.split(",")]))
        return
    if args.rescore:
        run, records = (Path(f) for f in args.rescore.split(","))
        text = json.dumps(rescore(run, records), indent=1)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return
    if args.quick:
        args.n, args.burst = 30, 16

    cluster = ClusterConfig.from_file(vllm_servers.DEFAULT_CLUSTER)
    inst = next(i for i in cluster.instances if i.id == INSTANCE)
    spec = next(m for m in cluster.models if m.name == inst.model)
    if spec.profile is None or spec.max_model_len is None:
        raise SystemExit(f"{INSTANCE}: its model needs a profile and max_model_len")
    shape = vllm_model.SHAPES[args.shape]
    if args.shape != "tiny":  # its own profile; 1 GiB of KV cache (the CPU build's unit)
        blocks = 2**30 // (spec.scheduler.block_size_tokens * shape.kv_bytes_per_token())
        sch = spec.scheduler.model_copy(update={"kv_blocks": blocks})
        spec = spec.model_copy(update={"profile": f"qwen3-{args.shape}@cpu", "scheduler": sch})
    assert spec.profile is not None
    model = load_profile(spec.profile)
    timing = TableTiming.from_profile(read_profiles(), spec.profile)
    sched = spec.scheduler
    models = [spec if m.name == spec.name else m for m in cluster.models]
    one = cluster.model_copy(update={"instances": [inst], "models": models})
    home = Path(tempfile.mkdtemp(prefix="real-vllm-bench-"))
    t_start = time.time()
    result: dict[str, Any] = {
        "instance": INSTANCE,
        "model": spec.name,
        "profile": spec.profile,
        "shape": args.shape,
        "load_average_start": [round(v, 2) for v in os.getloadavg()],
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "keep_records")},
        "traces": {},
    }
    all_records: list[dict[str, Any]] = []
    records_srv = vllm_servers.vllm_up(one, home=home, free_ports=True, shape=shape)
    try:
        endpoint = records_srv[0].address
        result["server_ready_s"] = records_srv[0].extra.get("ready_s")
        for trace in args.traces.split(","):
            burst, _ = requests_of(
                trace, args.burst, args.prompt_scale, args.output_scale,
                spec.max_output_tokens or 256, spec.max_model_len, offset=1000,
            )  # fmt: skip
            cap = measure_capacity(endpoint, spec.name, burst)
            # calibration: lone requests, one after another, never scored
            lone, _ = requests_of(
                trace, args.calib, args.prompt_scale, args.output_scale,
                spec.max_output_tokens or 256, spec.max_model_len, offset=2000,
            )  # fmt: skip
            # one client for all of them, as in the levels (a fresh client per request
            # paid its connection set-up inside the TTFT: ~4 ms more server time); each
            # sent once the one before is surely done (2 output tokens; twice its prefill)
            spaced, t_s = [], 0.0
            for r in lone:
                spaced.append(ReplayRequest(r.request_id, t_s, r.prompt_tokens, 2))
                t_s += args.calib_gap_s + 2.0 * float(model.prefill_ms(r.prompt_tokens)) / 1e3
            calib = asyncio.run(replay(endpoint, spec.name, spaced, seed=100))
            server_ms = server_ms_of(calib, model)
            all_records += [dict(r.as_dict(), trace=trace, level="calib") for r in calib]
            tr: dict[str, Any] = {
                "capacity_rps": round(cap, 3),
                "server_ms": round(server_ms, 2),
                "calib_gaps_ms": [
                    round(r.ttft_s * 1e3 - float(model.prefill_ms(r.prompt_tokens)), 1)
                    for r in calib
                    if not r.error
                ],
                "levels": {},
            }
            for k, level in enumerate(LEVELS):
                reqs, arr = requests_of(
                    trace, args.n, args.prompt_scale, args.output_scale,
                    spec.max_output_tokens or 256, spec.max_model_len, offset=k * args.n,
                )  # fmt: skip
                span = float(arr[-1]) if arr[-1] > 0 else 1.0
                rate = level * cap
                stretch = (len(reqs) - 1) / rate / span
                timed = [
                    ReplayRequest(
                        r.request_id, r.arrival_s * stretch, r.prompt_tokens, r.output_tokens
                    )
                    for r in reqs
                ]
                la = os.getloadavg()[0]
                recs = asyncio.run(replay(endpoint, spec.name, timed, seed=k))
                ev = evaluate(recs, model, sched, engine_timing=timing, server_ms=server_ms)
                ev["rate_rps"] = round(rate, 3)
                ev["load_average_1m"] = round(la, 2)
                ev["mean_prompt_tokens"] = round(float(np.mean([r.prompt_tokens for r in reqs])), 1)
                ev["mean_output_tokens"] = round(float(np.mean([r.output_tokens for r in reqs])), 1)
                tr["levels"][f"{int(level * 100)}%"] = ev
                all_records += [dict(r.as_dict(), trace=trace, level=level) for r in recs]
                print(json.dumps({trace: {f"{int(level * 100)}%": ev}}), file=sys.stderr)
            result["traces"][trace] = tr
    finally:
        vllm_servers.vllm_down(home)
    result["wall_s"] = round(time.time() - t_start, 1)
    result["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.keep_records:
        args.keep_records.write_text("\n".join(json.dumps(r) for r in all_records) + "\n")


def rescore(run: Path, records: Path) -> dict[str, Any]:
    """``run`` (an ``--out`` file) with every level scored again from its ``--keep-records``
    file: the current estimators and profile, ``server_ms`` from its calibration records."""
    from offline.vllm_replay import ReplayRecord

    result: dict[str, Any] = json.loads(run.read_text())
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    cluster = ClusterConfig.from_file(vllm_servers.DEFAULT_CLUSTER)
    spec = next(m for m in cluster.models if m.name == result["model"])
    shape = vllm_model.SHAPES[result.get("shape", "tiny")]
    profile = str(result["profile"])
    sched = spec.scheduler
    if result.get("shape", "tiny") != "tiny":
        blocks = 2**30 // (sched.block_size_tokens * shape.kv_bytes_per_token())
        sched = sched.model_copy(update={"kv_blocks": blocks})
    model = load_profile(profile)
    timing = TableTiming.from_profile(read_profiles(), profile)
    fields = set(ReplayRecord.__dataclass_fields__)

    def recs(trace: str, level: object) -> list[ReplayRecord]:
        return [
            ReplayRecord(**{k: v for k, v in r.items() if k in fields})
            for r in rows
            if r["trace"] == trace and r["level"] == level
        ]

    for trace, tr in result["traces"].items():
        server_ms = server_ms_of(recs(trace, "calib"), model)
        tr["server_ms"] = round(server_ms, 2)
        for name, ev in tr["levels"].items():
            new = evaluate(
                recs(trace, int(name.rstrip("%")) / 100),
                model,
                sched,
                engine_timing=timing,
                server_ms=server_ms,
            )
            keep = {k: ev[k] for k in ("rate_rps", "load_average_1m") if k in ev}
            tr["levels"][name] = {**new, **keep}
    result["rescored"] = True
    return result


COLUMNS = (
    ("sfs_plain", "SFS before (stream snapshot)"),
    ("sfs_residents_predicted", "catch-up, residents only (predicted)"),
    ("sfs_residents_real_lengths", "catch-up, residents only (real lengths)"),
    ("sfs_predicted_flat", "SFS (predicted lengths, one mean: before)"),
    ("sfs_predicted", "SFS (predicted lengths, conditional on decoded)"),
    ("sfs_real_lengths", "SFS (real lengths)"),
    ("sfs_later_predicted_flat", "SFS + later arrivals (predicted, one mean: before)"),
    ("sfs_later_predicted", "SFS + later arrivals (predicted, conditional on decoded)"),
    ("sfs_later_real_lengths", "SFS + later arrivals (real lengths)"),
    ("sim_engine", "sim engine"),
    ("throughput_baseline", "throughput"),
)


def summarise(files: list[Path]) -> str:
    """The median over runs of each cell (MAPE; real TTFT p50; load average) as markdown."""
    runs = [json.loads(f.read_text()) for f in files]
    head = (
        "| trace | load | runs | load avg 1m | real TTFT p50 ms | server_ms | "
        + " | ".join(c for _, c in COLUMNS)
        + " |"
    )
    lines = [head, "|" + "---|" * (6 + len(COLUMNS))]
    for trace in runs[0]["traces"]:
        for level in runs[0]["traces"][trace]["levels"]:
            cells = [r["traces"][trace]["levels"][level] for r in runs if trace in r["traces"]]
            srv = [r["traces"][trace]["server_ms"] for r in runs if trace in r["traces"]]

            def med(key: str, cells: list[dict[str, Any]] = cells) -> float:
                return float(np.median([c[key] for c in cells]))

            row = [
                trace,
                level,
                str(len(cells)),
                f"{med('load_average_1m'):.2f}",
                f"{med('p50_ms_real'):.0f}",
                f"{float(np.median(srv)):.1f}",
            ]
            for key, _ in COLUMNS:
                vals = [c[f"mape_{key}"] for c in cells if f"mape_{key}" in c]
                row.append(
                    f"{100 * float(np.median(vals)):.1f}% "
                    f"({', '.join(f'{100 * v:.0f}' for v in vals)})"
                )
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
