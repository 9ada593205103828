"""Drive a vLLM engine step by step in this process and record every step (``switchyard profile-vllm``).

Runs with the *engine's* Python (the vLLM venv), never the project's: it imports only vLLM and
the standard library. ``switchyard profile-vllm`` starts it, then fits Eq. 9 to what it wrote
(``offline/vllm_profile.py``).

How: ``LLMEngine`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core (scheduler
and model executor) in this process; with ``--executor mp`` (the default) the model runs in a
worker process of its own, pinned by vLLM, as under ``vllm serve``. The core's ``step_fn`` (schedule, execute the model,
update from its output) is wrapped to time each call (``time.perf_counter``) and the
scheduler's ``schedule`` to record what it put in the step: per request the tokens scheduled
now, the tokens it had computed before (its context) and its prompt length. Requests are
random token ids (no two alike; prefix caching is off) sent with ``ignore_eos`` so their
lengths are exact. The experiments (batch compositions) come from ``--plan`` (a JSON list).

Output (``--out``): a header line (``format``, ``model``, ``shape``, ``kv_blocks``,
``block_size_tokens``, ``provenance``), then one line per step
``{"ms": wall ms, "reqs": [[new, ctx, prompt_len], ...], "exp": index}``; warm-up steps carry
``"warmup": true``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FORMAT = "switchyard-vllm-steps/1"
MAX_STEPS_PER_PHASE = 10_000


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Recorder:
    """Wraps the engine core's step and its scheduler's schedule."""

    def __init__(self, core: object, out: object) -> None:
        self.core = core
        self.out = out
        self.exp = -1
        self.warmup = False
        self.steps = 0
        self._pending: list[list[int]] | None = None
        sched = core.scheduler  # type: ignore[attr-defined]
        orig_schedule = sched.schedule
        orig_step = core.step_fn  # type: ignore[attr-defined]

        def schedule(*a: object, **kw: object) -> object:
            before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
            so = orig_schedule(*a, **kw)
            reqs = []
            for rid, new in so.num_scheduled_tokens.items():
                r = sched.requests[rid]
                reqs.append([int(new), int(before.get(rid, 0)), int(r.num_prompt_tokens)])
            self._pending = reqs
            return so

        def step_fn() -> object:
            self._pending = None
            t0 = time.perf_counter()
            res = orig_step()
            ms = (time.perf_counter() - t0) * 1e3
            if self._pending:
                rec: dict[str, object] = {
                    "ms": round(ms, 4),
                    "reqs": self._pending,
                    "exp": self.exp,
                }
                if self.warmup:
                    rec["warmup"] = True
                self.out.write(json.dumps(rec, separators=(",", ":")) + "\n")  # type: ignore[attr-defined]
                self.steps += 1
            return res

        sched.schedule = schedule
        core.step_fn = step_fn  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory (config.json, tokenizer)")
    ap.add_argument("--name", required=True, help="profile's model name")
    ap.add_argument("--plan", required=True, help="JSON file: a list of experiments")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--executor",
        choices=("mp", "uni"),
        default="mp",
        help="mp: the model in a worker process of its own, pinned, as `vllm serve` runs it "
        "(each step pays the engine core's round trip to it); uni: in this process",
    )
    ap.add_argument("--command", default="", help="the user's command line, for provenance")
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    with open(args.plan, encoding="utf-8") as fh:
        plan = json.load(fh)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as fh:
        shape = {
            k: v
            for k, v in json.load(fh).items()
            if k
            in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "architectures",
            )
        }  # fmt: skip

    t_init = time.perf_counter()
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            enforce_eager=True,
            disable_log_stats=True,
            seed=args.seed,
            distributed_executor_backend=args.executor,
        )
    )
    init_s = time.perf_counter() - t_init
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    if getattr(core, "batch_queue", None) is not None:
        print("profile_steps: the engine uses a batch queue; steps overlap", file=sys.stderr)
        return 2
    kv_blocks = int(core.scheduler.kv_cache_config.num_blocks)
    block_size = int(engine.vllm_config.cache_config.block_size)
    vocab = int(shape.get("vocab_size", 1000))
    rng = random.Random(args.seed)

    def prompt(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(n)]}

    with open(args.out, "w", encoding="utf-8") as out:
        header = {
            "format": FORMAT,
            "model": args.name,
            "device": "cpu",
            "shape": shape,
            "kv_blocks": kv_blocks,
            "block_size_tokens": block_size,
            "provenance": {
                "source": "switchyard profile-vllm (vLLM engine driven step by step in process)",
                "vllm_version": getattr(vllm, "__version__", "?"),
                "torch_version": torch.__version__,
                "cpu_model": cpu_model(),
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "command": args.command,
                "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
                "engine": {
                    "max_num_seqs": args.max_num_seqs,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_model_len": args.max_model_len,
                    "dtype": args.dtype,
                    "load_format": args.load_format,
                    "enforce_eager": True,
                    "prefix_caching": False,
                    "executor": args.executor,
                    "engine_init_s": round(init_s, 1),
                },
                "experiments": len(plan),
            },
        }
        out.write(json.dumps(header, sort_keys=True) + "\n")
        rec = Recorder(core, out)
        counter = [0]

        def add(n_prompt: int, max_tokens: int) -> str:
            counter[0] += 1
            rid = f"r{counter[0]}"
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            engine.add_request(rid, prompt(n_prompt), sp)
            return rid

        def run_until(done: object) -> dict[str, int]:
            produced: dict[str, int] = {}
            for _ in range(MAX_STEPS_PER_PHASE):
                for o in engine.step():
                    produced[o.request_id] = len(o.outputs[0].token_ids) if o.outputs else 0
                    if o.finished:
                        produced[o.request_id] = 1 << 30
                if done(produced):  # type: ignore[operator]
                    return produced
                if not engine.has_unfinished_requests():
                    return produced
            raise RuntimeError("profile_steps: a phase did not finish")

        def experiment(e: dict[str, int]) -> None:
            n, ctx, q, s = e["decodes"], e["ctx"], e["prefill"], e["decode_steps"]
            bg = [add(max(1, ctx), s + 16) for _ in range(n)]
            if bg:  # their prefill, then `s` pure-decode steps
                seen: dict[str, int] = {}

                def prefilled(p: dict[str, int]) -> bool:
                    seen.update(p)
                    return all(seen.get(r, 0) >= 1 for r in bg)

                run_until(prefilled)
                for _ in range(s):
                    engine.step()
            if q:
                fg = add(q, 1)
                run_until(lambda p: p.get(fg, 0) >= 1)
            if bg:
                engine.abort_request(bg)
            while engine.has_unfinished_requests():
                engine.step()

        rec.warmup = True
        for e in ({"decodes": 2, "ctx": 64, "prefill": 64, "decode_steps": 4},) * 2:
            experiment(e)
        rec.warmup = False
        t0 = time.perf_counter()
        for i, e in enumerate(plan):
            rec.exp = i
            experiment(e)
        print(
            json.dumps(
                {"steps": rec.steps, "profile_s": round(time.perf_counter() - t0, 1),
                 "engine_init_s": round(init_s, 1)}
            )
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
