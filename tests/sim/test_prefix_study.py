"""The prefix study's workloads (sim.prefix_study): ShareGPT-style conversations become
multi-turn arrivals whose turns extend the previous prompt, spaced by the think-time rule;
a truncated dataset file still yields its complete records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from routing.datasets import RoutingData
from schemas import ClusterConfig
from schemas.prefix import TEXT_BLOCK_BYTES
from sim import prefix_study as ps
from sim.traffic import SloSpec, Workload


def conversation(turns: int, k: int) -> dict[str, object]:
    msgs = []
    for t in range(turns):
        msgs.append({"from": "human", "value": f"question {k}.{t} " + "q" * 1500})
        msgs.append({"from": "gpt", "value": "a" * (400 * (t + 1))})
    return {"id": f"c{k}", "conversations": msgs}


def test_a_truncated_json_array_yields_its_complete_records(tmp_path: Path) -> None:
    body = json.dumps([conversation(2, k) for k in range(3)])
    cut = tmp_path / "cut.json"
    cut.write_text(body[: len(body) - 40], encoding="utf-8")  # inside the last record
    assert [r["id"] for r in ps.read_json_records(cut)] == ["c0", "c1"]
    whole = tmp_path / "whole.json"
    whole.write_text(body, encoding="utf-8")
    assert len(ps.read_json_records(whole)) == 3


def test_conversations_become_turns_that_extend_each_other(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    data = [conversation(3, k) for k in range(4)] + [conversation(1, 9)]  # one turn: dropped
    path.write_text(json.dumps(data), encoding="utf-8")
    convs = ps.load_sharegpt(path, 10, np.random.default_rng(0))
    assert len(convs) == 4 and all(len(c.prompts) == 3 for c in convs)
    c = convs[0]
    assert c.prompts[1].startswith(c.prompts[0]) and c.output_tokens == [100, 200, 300]
    rd = RoutingData(
        texts=["t0", "t1"],
        tasks=["x", "x"],
        models=["m"],
        scores=np.array([[0.5], [0.7]]),
        prompt_tokens=np.array([10, 10]),
        output_tokens=np.full((2, 1), np.nan),
        input_usd_per_token=np.array([1e-7]),
        output_usd_per_token=np.array([1e-7]),
        query_ids=["a", "b"],
        cost_usd=np.full((2, 1), np.nan),
    )
    w = ps.sharegpt_workload(rd, convs, 1.0, np.random.default_rng(1), SloSpec.parse("fixed:1000"))
    assert w.n == 12 and w.prefix_hashes is not None
    assert w.prefix_block_tokens == TEXT_BLOCK_BYTES // 4
    # each turn's hashes extend an earlier turn's (its previous one)
    extends = 0
    for i in range(w.n):
        for j in range(i):
            hi, hj = w.prefix_hashes[i], w.prefix_hashes[j]
            if hj.size and hi.size > hj.size and (hi[: hj.size] == hj).all():
                extends += 1
                break
    assert extends == 8  # turns 2 and 3 of each of the 4 conversations
    assert (np.diff(w.arrival_s) >= 0).all()
    # turns of one conversation are apart by at least the rule's stream + read + type time:
    # replies of 100 and 200 tokens, next messages of ~380 tokens (typing capped at 60 s)
    by_conv: dict[int, list[float]] = {}
    for i in range(w.n):
        by_conv.setdefault(int(w.prefix_hashes[i][0]), []).append(float(w.arrival_s[i]))
    assert len(by_conv) == 4
    for times in by_conv.values():
        gaps = np.diff(times)
        floor = np.array([100 / 40 + 100 / 5 + 60.0, 200 / 40 + 200 / 5 + 60.0])
        assert (gaps > floor).all() and (gaps < floor + 200.0).all()


def test_think_time_streams_reads_types_and_pauses() -> None:
    reply = np.array([0, 400, 1000])
    message = np.array([0, 30, 500])
    got = ps.think_time_s(reply, message, np.random.default_rng(3))
    pause = 5.0 * np.exp(np.random.default_rng(3).standard_normal(3))
    # reading is capped at 60 s (skimming), typing at 60 s (pasting)
    np.testing.assert_allclose(got - pause, [0.0, 10.0 + 60.0 + 30.0, 25.0 + 60.0 + 60.0])
    assert (got > 0).all()
    with pytest.raises(ValueError, match="token counts must be >= 0"):
        ps.think_time_s(np.array([-1]), np.array([0]), np.random.default_rng(0))


def test_reuse_reference_counts_what_an_unbounded_and_a_sticky_lru_cache_find() -> None:
    from tests.sim.fakes import STEP

    model = {"name": "m", "input_usd_per_token": 1e-7, "output_usd_per_token": 1e-7,
             "step_time": STEP, "scheduler": {"kv_blocks": 4, "block_size_tokens": 16}}  # fmt: skip
    cl = ClusterConfig.model_validate(
        {"models": [model], "instances": [{"id": "m-0", "model": "m"}]}
    )
    # 16-token blocks; the cache holds 4 of them (64 tokens); the last prompt fits nowhere
    chains = [[1, 2, 3], [4, 5, 6], [1, 2, 7], [4, 5, 8], [4, 5, 8, 9], [1]]
    prompts = [48, 48, 48, 50, 60, 100]
    n = len(chains)
    w = Workload(np.arange(n, dtype=np.float64), np.zeros(n, dtype=np.int64),
                 np.array(prompts), np.zeros((n, 1)), np.zeros((n, 1)), np.full(n, 1e3),
                 [""] * n, [""] * n, ["m"],
                 prefix_hashes=[np.array(c, dtype=np.uint64) for c in chains],
                 prefix_block_tokens=16)  # fmt: skip
    ref = ps.reuse_reference(w, cl)
    total = 48 + 48 + 48 + 50 + 60
    # unbounded: turns 3 and 4 find 2 blocks, turn 5 three. The LRU (least recent first; a
    # prompt's blocks touched tail first, so its head is the most recent) keeps each chain's
    # head: 3 2 1 | 6 5 4 -> 1 6 5 4 | turn 3 finds 1: 7 2 1 -> 4 7 2 1 | turn 4 finds 4:
    # 8 5 4 -> 1 8 5 4 | turn 5 finds 4 5 8
    assert ref["unbounded_hit_rate"] == (32 + 32 + 48) / total
    assert ref["sticky_lru_hit_rate"] == (16 + 16 + 48) / total


def test_parents_name_the_turn_each_query_continues() -> None:
    chains = [[1, 2], [5], [1, 2, 3], [1, 9], [1, 2, 3, 4], []]
    n = len(chains)
    w = Workload(np.arange(n, dtype=np.float64), np.zeros(n, dtype=np.int64),
                 np.full(n, 100), np.zeros((n, 1)), np.zeros((n, 1)), np.full(n, 1e3),
                 [""] * n, [""] * n, ["m"],
                 prefix_hashes=[np.array(c, dtype=np.uint64) for c in chains],
                 prefix_block_tokens=16)  # fmt: skip
    parent = ps.parents(w)
    # [1, 9] shares block 1 with the latest query holding it (2); [1, 2, 3, 4] continues 2
    assert parent.tolist() == [-1, -1, 0, 2, 2, -1]


def test_mean_sd_over_seeds_and_versus_per_seed() -> None:
    def row(seed: int, policy: str, p50: float) -> dict[str, object]:
        base = {k: 0.5 for k in ps.METRICS}
        return {**base, "workload": "w", "policy": policy, "queries": 10, "seed": seed,
                "ttft_p50_ms": p50, "decide_p50_ms": 1.0}  # fmt: skip

    labels = [p[0] for p in ps.POLICIES]
    rows = [row(s, lab, p50) for s, p50s in ((0, (60, 100, 50, 70)), (1, (80, 100, 50, 70)))
            for lab, p50 in zip(labels, p50s, strict=True)]  # fmt: skip
    means = ps.mean_sd(rows)
    aware = next(r for r in means if r["policy"] == labels[0])
    assert aware["ttft_p50_ms"] == 70.0 and aware["ttft_p50_ms_sd"] == pytest.approx(14.142, abs=1e-3)
    assert aware["seeds"] == 2 and aware["ontime_utility_sd"] == 0.0
    per_seed = ps.versus_over_seeds(rows)["w"]["ttft_p50_reduction_vs_agnostic"]
    assert per_seed == pytest.approx([0.4, 0.2])
    assert ps.versus(means)["w"]["ttft_p50_reduction_vs_agnostic"] == pytest.approx(0.3)
