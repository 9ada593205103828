"""``batch.files``: OpenAI Batch API lines (as the ``openai`` SDK serialises its requests) and
Switchyard query lines become queries with stable ids; bad lines are named by line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from batch.files import (
    InputRules,
    JobFiles,
    bad_line_record,
    cost_bound_usd,
    read_input,
    read_lines,
    stable_id,
)
from schemas import ClusterConfig

CLUSTER = ClusterConfig.model_validate(
    {
        "models": [
            {"name": "a", "input_usd_per_token": 1e-7, "output_usd_per_token": 2e-7},
            {"name": "b", "input_usd_per_token": 1e-6, "output_usd_per_token": 3e-6},
        ],
        "instances": [{"id": "a-0", "model": "a"}, {"id": "b-0", "model": "b"}],
        "model_groups": {"cheap": ["a"]},
    }
)


def sdk_bodies(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """(url path, JSON body) of each request exactly as the ``openai`` SDK sends it."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content)))
        return httpx.Response(400, json={"error": {"message": "captured", "type": "x"}})

    client = openai.OpenAI(
        api_key="sk-test",
        base_url="http://sdk.invalid/v1",
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
        max_retries=0,
    )
    for kind, params in calls:
        with pytest.raises(openai.BadRequestError):
            if kind == "chat":
                client.chat.completions.create(**params)
            else:
                client.completions.create(**params)
    return sent


def batch_file(path: Path, bodies: list[tuple[str, dict[str, Any]]]) -> None:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}
        for i, (url, body) in enumerate(bodies)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_openai_lines_from_the_sdk_become_queries(tmp_path: Path) -> None:
    bodies = sdk_bodies(
        [
            ("chat", {"model": "a", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 9, "logit_bias": {"50256": -100}, "temperature": 0.2}),
            ("completion", {"model": "cheap", "prompt": "Say this", "max_tokens": 5, "seed": 3}),
            ("chat", {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}),
            ("chat", {"model": "a", "messages": [{"role": "user", "content": "x"}], "n": 2}),
        ]
    )  # fmt: skip
    assert [u for u, _ in bodies] == ["/v1/chat/completions", "/v1/completions"] + [
        "/v1/chat/completions"
    ] * 2
    src = tmp_path / "in.jsonl"
    batch_file(src, bodies)
    lines, bad = read_input(src, InputRules("job", CLUSTER))
    assert [ln.custom_id for ln in lines] == ["req-0", "req-1"]
    chat, completion = lines[0].query, lines[1].query
    assert chat.kind == "chat" and chat.logit_bias == {"50256": -100} and chat.max_tokens == 9
    assert completion.kind == "completion" and completion.model == "cheap"
    assert completion.id == stable_id("job", "req-1")
    # an OpenAI model name the cluster does not serve, and n > 1: each named, by line
    assert [(b.line_no, b.custom_id, b.param) for b in bad] == [
        (3, "req-2", "body.model"),
        (4, "req-3", "body.n"),
    ]
    assert "gpt-4o-mini" in bad[0].message and "--any-model" in bad[0].message
    assert "must be 1, got 2" in bad[1].message
    # --any-model: the router chooses; the line is valid
    lines2, bad2 = read_input(src, InputRules("job", CLUSTER, any_model=True))
    assert "req-2" in [ln.custom_id for ln in lines2] and len(bad2) == 1


def test_bad_lines_are_named_and_ids_stable(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"prompt": "hello"}\n{"prompt": "hello"}\nnot json\n{"id": "mine", "prompt": "x"}\n'
        '{"prompt": "x", "temperature": 9}\n[1]\n'
        '{"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}\n'
        '{"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
        '{"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": {"messages": []}}\n'
        '{"custom_id": "mine", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y"}}\n'
    )
    one, bad = read_input(src, InputRules("job", CLUSTER, default_max_tokens=32))
    two, _ = read_input(src, InputRules("job", CLUSTER, default_max_tokens=32))
    assert [ln.query.id for ln in one] == [ln.query.id for ln in two]
    assert len(one) == 3 and len({ln.query.id for ln in one}) == 3  # same text, other line
    assert all(ln.query.max_tokens == 32 for ln in one)
    named = {b.line_no: (b.param, b.message) for b in bad}
    assert "malformed JSON" in named[3][1]
    assert named[5][0] == "temperature" and "must be <= 2" in named[5][1]
    assert "JSON object" in named[6][1]
    assert named[7][0] == "method"
    assert named[8][0] == "url"
    assert named[9][0] == "body.prompt" and "required" in named[9][1]
    assert named[10][0] == "custom_id" and "repeats line 4" in named[10][1]
    # an error line for a bad input line carries its line number, custom id and field
    rec = bad_line_record(bad[0], "job")
    assert rec.error is not None and rec.error.line == 3 and rec.response is None


def test_cost_bound_covers_the_allowed_models_only(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "abc", "max_tokens": 10, "model": "cheap"}\n{"prompt": "abc", "max_tokens": 10}\n')
    lines, _ = read_input(src, InputRules("job", CLUSTER))
    a, b = CLUSTER.model("a"), CLUSTER.model("b")
    assert cost_bound_usd(lines[0].query, CLUSTER) == pytest.approx(a.max_cost_usd(lines[0].query))
    assert cost_bound_usd(lines[1].query, CLUSTER) == pytest.approx(b.max_cost_usd(lines[1].query))


def test_job_files_and_torn_lines(tmp_path: Path) -> None:
    files = JobFiles.for_output(tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    assert files.errors.name == "out.errors.jsonl" and files.status.name == "out.batch.json"
    files.output.write_text(
        '{"id": "x", "custom_id": "c1", "response": null, "error": null}\n{"id": "y", "cust'
    )
    assert [ln.custom_id for ln in read_lines(files.output)] == ["c1"]
