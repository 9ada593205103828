"""``switchyard replay``'s report and ``switchyard batch`` (pure parts, then for real).

The integration test runs the router (test-only policy), one worker and a fake vLLM
server, then a batch job that is killed (SIGKILL) halfway and run again: the output
ends with one line per query that fit the budget, none twice, and the job's ledger and
actual spend stay within the budget.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest

from schemas import ClusterConfig, Result
from switchyard.commands.batch import cost_bound_usd, done_ids, read_jobs
from switchyard.commands.replay import ReplayRecord, build_report

CLUSTER = {
    "models": [
        {
            "name": "a",
            "input_usd_per_token": 1e-7,
            "output_usd_per_token": 2e-7,
            "max_concurrency": 16,
            "profile": "llama-2-7b-hf@h100",
        },
        {
            "name": "b",
            "input_usd_per_token": 1e-6,
            "output_usd_per_token": 3e-6,
            "max_concurrency": 16,
            "profile": "llama-2-70b-hf@h100",
        },
    ],  # fmt: skip
    "instances": [{"id": "a-0", "model": "a"}, {"id": "b-0", "model": "b"}],
}


def _result(
    qid: str, model: str, ttft: float | None, cost: float, error: str | None = None, inst: str = "i"
) -> Result:
    return Result(query_id=qid, tenant="default", instance_id=inst, model=model, ttft_ms=ttft,
                  cost_usd=cost, error=error, finished_at=1.0)  # fmt: skip


def test_report_counts_utility_only_on_time() -> None:
    scores = np.array([[0.9, 0.5], [0.2, 0.8], [1.0, 1.0], [0.7, 0.7]])
    recs = [
        ReplayRecord("q0", 0, 1000.0, 0.0, _result("q0", "a", 100.0, 0.01)),  # on time: 0.9
        ReplayRecord("q1", 1, 1000.0, 0.0, _result("q1", "b", 5000.0, 0.02)),  # late: counts 0
        ReplayRecord("q2", 2, 1000.0, 0.0, _result("q2", "a", None, 0.0, error="boom")),
        ReplayRecord("q3", 3, 1000.0, 0.0, None),  # no result
    ]
    rep = build_report(recs, scores, ["a", "b"], budget_usd=1.0)
    assert rep.queries == 4 and rep.results == 3 and rep.missing == 1 and rep.errors == 1
    assert rep.ontime_utility == pytest.approx(0.9 / 4)
    assert rep.mean_utility == pytest.approx((0.9 + 0.8) / 4)
    assert rep.slo_attainment == pytest.approx(0.25)
    assert rep.spend_usd == pytest.approx(0.03)
    assert rep.ttft_p50_ms == pytest.approx(2550.0)
    assert rep.per_instance["i"]["queries"] == 3 and rep.per_instance["i"]["errors"] == 1


def test_batch_ids_are_stable_and_bad_lines_are_named(tmp_path: Path) -> None:
    cluster = ClusterConfig.model_validate(CLUSTER)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n{"prompt": "hello"}\nnot json\n{"id": "mine", "prompt": "x", "max_tokens": 7}\n'
                   '{"prompt": "x", "temperature": 9}\n[1]\n')  # fmt: skip
    one = read_jobs(src, "job", cluster, 32, None)
    two = read_jobs(src, "job", cluster, 32, None)
    assert [q.id for q in one.queries] == [q.id for q in two.queries]
    assert (
        len(one.queries) == 3 and len({q.id for q in one.queries}) == 3
    )  # same text, other line: other id
    assert "mine" in [q.id for q in one.queries]
    assert any(":3: malformed JSON" in b for b in one.bad_lines)
    assert any(":5:" in b and "temperature" in b for b in one.bad_lines)
    assert any(":6:" in b and "JSON object" in b for b in one.bad_lines)
    for q in one.queries:  # the bound covers the dearest model with one token per byte
        dearest = max(
            m.cost_usd(len(q.text().encode()), q.output_cap_tokens() or 0) for m in cluster.models
        )
        assert cost_bound_usd(q, cluster) >= dearest
    out = tmp_path / "out.jsonl"
    out.write_text('{"query_id": "mine"}\n{"query_id": "torn')
    assert done_ids(out) == {"mine"}


def _ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


@pytest.mark.integration
async def test_batch_survives_a_kill_and_stays_in_budget(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    from state import StateStore
    from switchyard import services
    from switchyard.processes import ProcessGroup

    rid = "b" + uuid.uuid4().hex[:6]
    port = services.free_port()
    spec = {
        "models": [
            {
                "name": "a",
                "profile": "llama-2-7b-hf@h100",
                "input_usd_per_token": 1e-7,
                "output_usd_per_token": 2e-7,
                "max_concurrency": 16,
            }
        ],  # fmt: skip
        "instances": [{"id": f"{rid}-a", "model": "a", "endpoint": f"http://127.0.0.1:{port}"}],
        "tenants": [{"tenant": "default", "budget_usd": 100.0, "period_s": 86400}],
    }
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    env = dict(
        os.environ,
        SWITCHYARD_KAFKA=kafka_bootstrap,
        SWITCHYARD_REDIS=redis_url,
        SWITCHYARD_NAMESPACE=f"t{rid}",
    )
    procs = ProcessGroup(tmp_path / "logs", env=env)
    n = 200
    budget = 8e-4
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"prompt {i}: " + "tell me more " * 5, "max_tokens": 16}) + "\n"
                           for i in range(n)))  # fmt: skip
    out = tmp_path / "out.jsonl"
    batch_args = ["batch", "--input", str(src), "--budget-usd", str(budget), "--out", str(out),
                  "--cluster", str(cluster_file), "--concurrency", "32", "--result-timeout-s", "60", "--json"]  # fmt: skip
    try:
        procs.switchyard("vllm", "fake-vllm", "--profile", "llama-2-7b-hf@h100", "--port", str(port), "--model", "a",
                         "--time-scale", "5", "--mean-output-tokens", "16")  # fmt: skip
        await asyncio.to_thread(_ready, f"http://127.0.0.1:{port}/v1/models")
        router = procs.switchyard("router", "router", "--cluster", str(cluster_file), "--policy",
                                  "tests.streams.fake_router:factory", "--from", "latest", "--app-id", f"router-{rid}")  # fmt: skip
        await asyncio.to_thread(procs.wait_for_line, router, "assigned queries partitions", 90)
        procs.switchyard("worker", "worker", "--instance", f"{rid}-a", "--cluster", str(cluster_file),
                         "--backend", "vllm", "--heartbeat-s", "0.5", "--log-level", "WARNING")  # fmt: skip
        store = await StateStore.connect(redis_url, namespace=f"t{rid}")
        try:
            async with asyncio.timeout(60):
                while not (await store.snapshots([f"{rid}-a"], time.time()))[f"{rid}-a"].alive:
                    await asyncio.sleep(0.2)

            first = procs.switchyard("batch-1", *batch_args)
            async with asyncio.timeout(90):
                while len(done_ids(out)) < 30:
                    assert first.alive(), first.tail()
                    await asyncio.sleep(0.1)
            procs.kill(first)  # an interruption at an arbitrary point
            kept = done_ids(out)
            second = procs.switchyard("batch-2", *batch_args)
            await asyncio.to_thread(second.proc.wait, 120)
            assert second.proc.returncode == 0, second.tail()
            summary = json.loads(second.tail().strip().splitlines()[-1])

            lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
            ids = [x["query_id"] for x in lines]
            assert len(ids) == len(set(ids)), "a query appears twice in the output"
            assert summary["skipped_done"] == len(kept)
            assert summary["over_budget"] > 0, "the budget should stop part of the job"
            assert len(ids) + summary["over_budget"] == n
            spent = sum(x["cost_usd"] for x in lines)
            assert spent <= budget + 1e-12
            status = await store.budget_status("default", f"batch-{src.stem}")
            assert status.committed_usd <= budget + 1e-9
            assert status.reserved_usd == pytest.approx(0.0, abs=1e-9)  # every reservation settled
        finally:
            await store.close()
    finally:
        procs.stop_all()
