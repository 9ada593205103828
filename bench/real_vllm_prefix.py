"""Prefix-aware vs prefix-agnostic ``batch-ilp-sfs`` on two REAL vLLM servers with prefix
caching on (issue 14 item 5, "repeat it there"), a multi-turn workload whose turns share
their conversation prefix.

    nice -n 10 .venv/bin/python bench/real_vllm_prefix.py [--quick]

Starts the two instances of configs/clusters/real-vllm-cpu.yaml (``switchyard.vllm_servers``)
with automatic prefix caching switched on for both models (the shipped config leaves it off
for ``qwen3-tiny-narrow``; nothing else changes), then per policy drives them the way the
router service and its workers do, in one process and without Kafka or Redis:

* every ``--window-ms`` the queries that arrived are decided together by the policy
  (``routing.policies``, the default quality predictor) on views built from what this
  process has running on each server (prompt, prefilled, decoded tokens: what workers
  report) and each instance's LRU prefix model (``routing.prefix.LruPrefixModel``, the same
  rules as the Redis model of ``state.prefix``: touched when routed and when finished);
* a routed query goes to its server through the worker's backend (``VllmBackend``), its
  TTFT counted from its arrival (window wait included, as a Result's ``ttft_ms``);
* each server's ``/metrics`` is scraped every second into a ``PrefixReconciler`` fed with
  the model's predicted cached tokens (``routing.prefix.routed_hit_tokens``), as a worker does.

Workload: ``--conversations`` conversations arriving Poisson (``--rate`` per second), each
``--turns`` turns; a turn's prompt is the conversation so far (a shared system text, the
earlier user turns and fixed assistant replies, then the new user turn), sent after the
previous turn's answer plus ``--think-s``. The text is synthetic words, seeded; each policy's
run gets its own conversation texts (same lengths, a run tag in the first block), so no run
finds another's blocks in the engines' caches.

Reported per policy: the engines' own prefix-cache hit rate (``vllm:prefix_cache_hits_total``
/ ``_queries_total``, deltas over the run, both servers), the model's predicted hit rate
(predicted cached / estimated prompt tokens of the queries routed), TTFT p50/p99, SLO
attainment (``--slo-ms``), and where the turns went. Timings on a shared 2-core machine are
noisy: the load average is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loaders.predictor import load_predictor  # noqa: E402
from loaders.profiles import profiles_for  # noqa: E402
from offline.predictor import ensure_default_predictor  # noqa: E402
from routing.policies import RouterContext, make_router  # noqa: E402
from routing.prefix import LruPrefixModel, routed_hit_tokens  # noqa: E402
from routing.types import Budget, InstanceState, InstanceView, Router  # noqa: E402
from schemas import ClusterConfig, DecisionStatus, Query  # noqa: E402
from schemas.cluster import ModelSpec  # noqa: E402
from switchyard import vllm_servers  # noqa: E402
from workers.backends.base import GenerationRequest  # noqa: E402
from workers.backends.vllm import VllmBackend, VllmConfig, parse_engine_load  # noqa: E402
from workers.prefix_reconcile import PrefixReconciler  # noqa: E402

WORDS = (
    "the of and to in is that for it as with was on be by at this from or an are not have "
    "which one you had all were their but there been if more when will would who so no "
    "time system data model cache query router engine token request window policy turn "
    "answer question value price budget server worker stream block prefix memory result"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Conversation:
    cid: str
    start_s: float
    system: str
    users: list[str]
    replies: list[str]

    def prompt(self, turn: int) -> str:
        parts = [self.system]
        for t in range(turn):
            parts += [f"User: {self.users[t]}", f"Assistant: {self.replies[t]}"]
        parts.append(f"User: {self.users[turn]}\nAssistant:")
        return "\n".join(parts)


def conversations(args: argparse.Namespace, tag: str) -> list[Conversation]:
    """Same seed, same lengths and arrival times for every run; ``tag`` makes the texts
    (and so the engines' cache blocks) of each run its own."""
    rng = random.Random(args.seed)
    out, t = [], 0.0
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)
        body = random.Random(f"{tag}-{args.seed}-{c}")
        system = f"[{tag} conversation {c}] " + words(body, args.system_words)
        users = [words(body, args.user_words) for _ in range(args.turns)]
        replies = [words(body, args.reply_words) for _ in range(args.turns)]
        out.append(Conversation(f"{tag}-c{c}", t, system, users, replies))
    return out


@dataclass
class Running:
    prompt: int
    predicted_out: int
    prefilled: int = 0
    decoded: int = 0


@dataclass
class Instance:
    iid: str
    spec: ModelSpec
    backend: VllmBackend
    address: str
    model: LruPrefixModel
    reconciler: PrefixReconciler
    running: dict[str, Running] = field(default_factory=dict)
    counters0: tuple[float, float] | None = None

    def view(self) -> InstanceView:
        rows = list(self.running.values())
        state = InstanceState(
            np.array([r.prompt for r in rows], dtype=np.int64),
            np.array([r.prefilled for r in rows], dtype=np.int64),
            np.array([r.decoded for r in rows], dtype=np.int64),
            np.array([r.predicted_out for r in rows], dtype=np.int64),
        )
        free = max(0, self.spec.max_concurrency - len(rows))
        return InstanceView(self.iid, self.spec.name, state, free, prefix_hashes=self.model.cached())


async def counters(client: httpx.AsyncClient, address: str) -> tuple[float, float] | None:
    resp = await client.get(address + "/metrics", timeout=5.0)
    return parse_engine_load(resp.text).prefix_counters


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def run_policy(
    name: str, router: Router, cluster: ClusterConfig, addresses: dict[str, str],
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    tag = ("aware" if "aware" in name and "agnostic" not in name else "agnostic") + uuid.uuid4().hex[:6]
    convs = conversations(args, tag)
    insts: dict[str, Instance] = {}
    for inst in cluster.instances:
        spec = cluster.model(inst.model)
        cap = float(spec.scheduler.kv_blocks * spec.scheduler.block_size_tokens)
        be = VllmBackend(VllmConfig(endpoint=addresses[inst.id], model=spec.name,
                                    max_output_tokens=args.max_tokens))  # fmt: skip
        await be.start()
        insts[inst.id] = Instance(inst.id, spec, be, addresses[inst.id], LruPrefixModel(cap),
                                  PrefixReconciler(cap, cap))  # fmt: skip
    client = httpx.AsyncClient()
    for ins in insts.values():
        ins.counters0 = await counters(client, ins.address)
        ins.reconciler.scrape(ins.counters0)
    pending: list[tuple[Query, float]] = []  # (query, arrival)
    rows: list[dict[str, Any]] = []
    predicted_tokens = prompt_tokens = 0.0
    t0 = time.time()
    done = asyncio.Event()
    left = len(convs) * args.turns
    tasks: set[asyncio.Task[None]] = set()

    def arrive(c: Conversation, turn: int) -> None:
        q = Query(id=f"{c.cid}-t{turn}", prompt=c.prompt(turn), max_tokens=args.max_tokens,
                  ttft_slo_ms=args.slo_ms, created_at=time.time())  # fmt: skip
        pending.append((q, time.time()))

    async def conversation(c: Conversation) -> None:
        await asyncio.sleep(c.start_s)
        try:
            arrive(c, 0)
        except Exception as exc:  # a bench bug: said, and the run ends
            print(f"{c.cid}: {exc!r}", file=sys.stderr)
            done.set()

    async def serve(ins: Instance, q: Query, arrived: float, turn_of: tuple[Conversation, int],
                    predicted: int) -> None:  # fmt: skip
        nonlocal left
        prompt = q.estimated_prompt_tokens()
        r = ins.running[q.id] = Running(prompt, args.max_tokens)

        def progress(prefilled: int, decoded: int) -> None:
            r.prefilled, r.decoded = min(prompt, max(prefilled, prompt if decoded else 0)), decoded

        ins.reconciler.served(predicted)
        req = GenerationRequest(q, uuid.uuid4().hex, prompt, args.max_tokens)
        try:
            gen = await ins.backend.generate(req, progress)
        except Exception as exc:  # a bench bug or a dead server: said, and the run ends
            print(f"{q.id} on {ins.iid}: {exc!r}", file=sys.stderr)
            done.set()
            raise
        ins.running.pop(q.id, None)
        hashes, bt = q.prefix_blocks()
        n = min(len(hashes), int(prompt / bt + 1e-9))
        ins.model.touch(hashes[:n], bt)  # finished there (the worker's touch)
        ttft = None if gen.first_token_at is None else (gen.first_token_at - arrived) * 1000.0
        rows.append({"id": q.id, "instance": ins.iid, "ttft_ms": ttft, "error": gen.error,
                     "prompt_tokens": gen.prompt_tokens, "predicted_cached": predicted,
                     "est_prompt_tokens": prompt})  # fmt: skip
        c, turn = turn_of
        left -= 1
        if turn + 1 < args.turns:
            await asyncio.sleep(args.think_s)
            arrive(c, turn + 1)
        if left == 0:
            done.set()

    async def scrape_loop() -> None:
        while not done.is_set():
            await asyncio.sleep(1.0)
            for ins in insts.values():
                ins.reconciler.scrape(await counters(client, ins.address))

    by_id = {c.cid: c for c in convs}
    for c in convs:
        tasks.add(asyncio.create_task(conversation(c)))
    scraper = asyncio.create_task(scrape_loop())
    windows = 0
    while not done.is_set():
        await asyncio.sleep(args.window_ms / 1000.0)
        if time.time() - t0 > args.max_run_s:
            print(f"{name}: stopped at --max-run-s with {left} turns left", file=sys.stderr)
            break
        if not pending:
            continue
        batch, pending[:] = list(pending), []
        queries = [q for q, _ in batch]
        views = [ins.view() for ins in insts.values()]
        decisions = router.decide(queries, views, Budget(1.0, {"default": 1.0}), time.time())
        windows += 1
        routed = [(q, a, d) for (q, a), d in zip(batch, decisions, strict=True)
                  if d.status == DecisionStatus.ROUTED and d.instance_id is not None]  # fmt: skip
        held = {iid: ins.model.cached() for iid, ins in insts.items()}
        hits = routed_hit_tokens([q for q, _, _ in routed], [str(d.instance_id) for *_, d in routed], held)
        back = {q.id for q, _, _ in routed}
        pending.extend((q, a) for q, a in batch if q.id not in back)  # deferred: next window
        for (q, a, d), h in zip(routed, hits, strict=True):
            ins = insts[str(d.instance_id)]
            hashes, bt = q.prefix_blocks()
            n = min(len(hashes), int(q.estimated_prompt_tokens() / bt + 1e-9))
            ins.model.touch(hashes[:n], bt)  # routed there (the router's touch)
            predicted_tokens += float(h or 0)
            prompt_tokens += q.estimated_prompt_tokens()
            cid, turn = q.id.rsplit("-t", 1)
            tasks.add(asyncio.create_task(serve(ins, q, a, (by_id[cid], int(turn)), int(h or 0))))
    scraper.cancel()
    wall = time.time() - t0
    queried = hit = 0.0
    per_inst: dict[str, Any] = {}
    for ins in insts.values():
        c1 = await counters(client, ins.address)
        assert c1 is not None and ins.counters0 is not None, f"{ins.iid}: no prefix counters"
        dq, dh = c1[0] - ins.counters0[0], c1[1] - ins.counters0[1]
        queried, hit = queried + dq, hit + dh
        per_inst[ins.iid] = {
            "engine_queried_tokens": dq, "engine_hit_tokens": dh,
            "engine_hit_rate": round(dh / dq, 4) if dq else None,
            "turns": sum(1 for r in rows if r["instance"] == ins.iid),
            "reconciled_capacity_tokens": ins.reconciler.capacity_tokens,
        }  # fmt: skip
        await ins.backend.close()
    await client.aclose()
    for t in tasks:
        t.cancel()
    ok = [r for r in rows if r["error"] is None and r["ttft_ms"] is not None]
    ttfts = [float(r["ttft_ms"]) for r in ok]
    return {
        "policy": name,
        "turns_served": len(ok),
        "errors": len(rows) - len(ok),
        "engine_hit_rate": round(hit / queried, 4) if queried else None,
        "model_predicted_hit_rate": round(predicted_tokens / prompt_tokens, 4) if prompt_tokens else None,
        "ttft_p50_ms": round(pct(ttfts, 50), 1),
        "ttft_p99_ms": round(pct(ttfts, 99), 1),
        "slo_attainment": round(sum(t <= args.slo_ms for t in ttfts) / max(1, len(rows)), 4),
        "engine_prompt_tokens_mean": round(float(np.mean([r["prompt_tokens"] for r in ok])), 1) if ok else None,
        "windows": windows,
        "wall_s": round(wall, 1),
        "load_average_end": [round(v, 2) for v in os.getloadavg()],
        "instances": per_inst,
    }  # fmt: skip


async def run_on_fake(name: str, router: Router, cluster: ClusterConfig,
                      args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """``--fake``: the same run on fake-vllm servers (the simulated engine with the models'
    profiles and prefix caching), in this process: a check of the bench itself."""
    from workers.fake_vllm import FakeVllmConfig, build_server, start_server

    servers = []
    for inst in cluster.instances:
        spec = cluster.model(inst.model)
        cfg = FakeVllmConfig(model=spec.name, max_model_len=int(spec.max_model_len or 32_768))
        servers.append((inst.id, await start_server(build_server(profile=spec.profile,
                                                                 scheduler=spec.scheduler, config=cfg))))  # fmt: skip
    try:
        return await run_policy(name, router, cluster, {i: s.url for i, s in servers}, args)
    finally:
        for _, srv in servers:
            await srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 conversations x 3 turns")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=1.0, help="conversations per second")
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--system-words", type=int, default=240)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--reply-words", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slo-ms", type=float, default=250.0)
    ap.add_argument("--window-ms", type=float, default=50.0)
    ap.add_argument("--max-run-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--fake", action="store_true", help="fake-vllm servers instead (no vLLM)")
    args = ap.parse_args()
    if args.quick:
        args.conversations, args.turns = 8, 3
    shipped = ClusterConfig.from_file(vllm_servers.DEFAULT_CLUSTER)
    models = [m.model_copy(update={"scheduler": m.scheduler.model_copy(update={"prefix_caching": True})})
              for m in shipped.models]  # fmt: skip
    cluster = shipped.model_copy(update={"models": models})
    quality = load_predictor(ensure_default_predictor(Path(tempfile.gettempdir()) / "switchyard-predictors"))
    result: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "load_average_start": [round(v, 2) for v in os.getloadavg()],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [],
    }
    policies = (("batch-ilp-sfs (prefix-aware)", True), ("batch-ilp-sfs (prefix-agnostic)", False))
    if args.fake:
        for name, aware in policies:
            ctx = RouterContext.build(cluster, quality, length=getattr(quality, "length", None),
                                      prefix_aware=aware, profiles=profiles_for(cluster))  # fmt: skip
            run = asyncio.run(run_on_fake(name, make_router("batch-ilp-sfs", ctx), cluster, args))
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
        print(json.dumps(result, indent=1))
        return
    home = Path(tempfile.mkdtemp(prefix="swy-prefix-vllm-"))
    records = vllm_servers.vllm_up(cluster, home=home, free_ports=True)
    try:
        addresses = {str(r.extra["instance"]): r.address for r in records}
        live = vllm_servers.with_endpoints(cluster, records)
        for name, aware in policies:
            ctx = RouterContext.build(live, quality, length=getattr(quality, "length", None),
                                      prefix_aware=aware, profiles=profiles_for(live))  # fmt: skip
            run = asyncio.run(run_policy(name, make_router("batch-ilp-sfs", ctx), live, addresses, args))
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
    finally:
        vllm_servers.vllm_down(home)
    result["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
