"""``switchyard batch`` for real: OpenAI Batch API files (bodies as the ``openai`` SDK sends
them) through the router, workers and fake vLLM servers, checked with the SDK's own types.

- a job killed (SIGKILL) halfway and run again: every line ends up exactly once in the
  output or the error file, the responses parse as ``openai`` completions, ``model``
  constrained where a line named one, bad and over-budget lines are in the error file
  with their reason, the status file parses as ``openai.types.Batch``, the job-wide
  spend (both runs) stays within the budget, and the exit code says lines failed;
- a cancelled job keeps the results of what it sent, and a resumed run finishes it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai.types
import openai.types.chat
import pytest

from tests.batch.test_files import sdk_bodies
from tests.frontdoor import LARGE, SMALL, Stack, stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def svc(
    kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    with stack(tmp_path_factory.mktemp("batch"), kafka_bootstrap, redis_url) as st:
        yield st


def write_jobs(
    path: Path, n_chat: int, n_completion: int, extra: list[str] = (), first: list[str] = ()  # type: ignore[assignment]
) -> None:
    models = [None, SMALL, "big"]
    calls: list[tuple[str, dict[str, Any]]] = []
    for i in range(n_chat):
        p: dict[str, Any] = {"model": models[i % 3] or "auto",
                             "messages": [{"role": "user", "content": f"question {i}: why " * 3}],
                             "max_tokens": 8, "temperature": 0.5}  # fmt: skip
        calls.append(("chat", p))
    for i in range(n_completion):
        calls.append(("completion", {"model": "auto", "prompt": f"complete {i}", "max_tokens": 8,
                                     "logit_bias": {"11": 5}}))  # fmt: skip
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
             for i, (url, body) in enumerate(sdk_bodies(calls))]  # fmt: skip
    path.write_text("\n".join([*first, *lines, *extra]) + "\n")


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


async def wait_lines(path: Path, n: int, child: Any, timeout_s: float = 120) -> None:
    async with asyncio.timeout(timeout_s):
        while not path.exists() or len(path.read_text().splitlines()) < n:
            assert child.alive(), child.tail()
            await asyncio.sleep(0.1)


async def test_killed_job_resumes_within_budget_with_openai_files(svc: Stack, tmp_path: Path) -> None:
    from batch.files import InputRules, cost_bound_usd, read_input
    from schemas import ClusterConfig
    from state import StateStore

    src = tmp_path / "jobs.jsonl"
    bad = ['{"custom_id": "bad-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "auto"}}',
           "not json"]  # fmt: skip
    # first in the file, so it is sent before the budget runs out whatever the timing
    legacy = ['{"prompt": "a legacy line", "max_tokens": 4, "id": "legacy-1"}']
    write_jobs(src, 90, 30, bad, legacy)
    lines, _ = read_input(src, InputRules("jobs", ClusterConfig.model_validate(svc.spec)))
    bounds = sorted(cost_bound_usd(ln.query, ClusterConfig.model_validate(svc.spec)) for ln in lines)
    # worst cases are ~3-5x the actual costs here: room for roughly half the lines
    budget = 0.15 * sum(bounds)
    out = tmp_path / "out.jsonl"
    args = ["batch", "--input", str(src), "--out", str(out), "--budget-usd", repr(budget),
            "--concurrency", "16", "--result-timeout-s", "60", "--json"]  # fmt: skip

    first = svc.run("batch-1", *args)
    await wait_lines(out, 25, first)
    svc.procs.kill(first)  # at an arbitrary point
    second = svc.run("batch-2", *args)
    await asyncio.to_thread(second.proc.wait, 180)
    assert second.proc.returncode == 1, second.tail()  # lines failed: bad ones, over budget

    status = openai.types.Batch.model_validate_json((tmp_path / "out.batch.json").read_text())
    assert status.status == "completed" and status.request_counts is not None
    outputs, errors = records(out), records(tmp_path / "out.errors.jsonl")
    ids = [r["custom_id"] for r in outputs] + [r["custom_id"] for r in errors]
    assert len(ids) == len(set(ids)) == 123, "each line exactly once in output or errors"
    counts = status.request_counts
    assert (counts.total, counts.completed, counts.failed) == (123, len(outputs), len(errors))
    codes = {r["custom_id"]: r["error"]["code"] for r in errors}
    assert codes["bad-1"] == "invalid_request" and None in codes  # no "messages"; "not json"
    over = [c for c, code in codes.items() if code == "over_budget"]
    assert over and 30 <= len(outputs) < 121, (len(outputs), codes)
    assert "legacy-1" in [r["custom_id"] for r in outputs]
    by_id = {ln.custom_id: ln for ln in lines}
    for r in outputs:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        line = by_id[r["custom_id"]]
        if line.query.kind == "chat":
            resp: Any = openai.types.chat.ChatCompletion.model_validate(body)
            assert resp.choices[0].message.content
        else:
            resp = openai.types.Completion.model_validate(body)
            assert resp.choices[0].text
        assert resp.usage is not None and resp.usage.completion_tokens == line.query.max_tokens
        if line.query.model == SMALL:
            assert resp.model == SMALL
        if line.query.model == "big":
            assert resp.model == LARGE
    # job-wide spend: the ledger's, across both runs, within the budget, all settled
    sy = json.loads((tmp_path / "out.batch.json").read_text())["switchyard"]
    assert sy["runs"] == 2
    store = await StateStore.connect(svc.env["SWITCHYARD_REDIS"], namespace=svc.env["SWITCHYARD_NAMESPACE"])
    try:
        ledger = await store.budget_status(sy["ledger"]["tenant"], sy["ledger"]["period"])
    finally:
        await store.close()
    assert ledger.spent_usd <= budget + 1e-9 and ledger.reserved_usd == pytest.approx(0.0, abs=1e-12)
    recorded = sum(r["switchyard"]["cost_usd"] for r in outputs + errors)
    assert sy["spend_usd"] == pytest.approx(ledger.spent_usd, rel=1e-6)
    assert recorded == pytest.approx(ledger.spent_usd, rel=1e-6)  # nothing paid twice


async def test_cancel_keeps_partial_results_and_resume_finishes(svc: Stack, tmp_path: Path) -> None:
    src = tmp_path / "slow.jsonl"
    write_jobs(src, 150, 0)
    out = tmp_path / "slow-out.jsonl"
    args = ["batch", "--input", str(src), "--out", str(out), "--budget-usd", "10",
            "--concurrency", "2", "--cancel-grace-s", "30"]  # fmt: skip
    job = svc.run("slow-1", *args)
    await wait_lines(out, 5, job)
    canceller = svc.run("cancel", "batch", "--input", str(src), "--out", str(out), "--cancel")
    await asyncio.to_thread(canceller.proc.wait, 30)
    await asyncio.to_thread(job.proc.wait, 60)
    assert job.proc.returncode == 3, job.tail()
    status = openai.types.Batch.model_validate_json((tmp_path / "slow-out.batch.json").read_text())
    assert status.status == "cancelled" and status.cancelled_at and status.cancelling_at
    kept = records(out)
    assert 5 <= len(kept) < 150 and records(tmp_path / "slow-out.errors.jsonl") == []
    resumed = svc.run("slow-2", *args[:-4], "--concurrency", "32")
    await asyncio.to_thread(resumed.proc.wait, 180)
    assert resumed.proc.returncode == 0, resumed.tail()
    final = records(out)
    assert len(final) == 150 and len({r["custom_id"] for r in final}) == 150
    assert [r["custom_id"] for r in final[: len(kept)]] == [r["custom_id"] for r in kept]
