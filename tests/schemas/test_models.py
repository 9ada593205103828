"""Cluster config, snapshots, results and dead letters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import (
    TOPIC_BODIES,
    BadMessage,
    ClusterConfig,
    DeadLetter,
    InstanceSnapshot,
    ResidentRequest,
    Result,
    parse_model,
)

CLUSTER_YAML = """
models:
  - name: small
    input_usd_per_token: 1.0e-7
    output_usd_per_token: 2.0e-7
    profile: llama-2-7b-hf@h100
    scheduler: {policy: vllm-v1, max_num_batched_tokens: 4096}
  - name: cloud-big
    kind: cloud
    input_usd_per_token: 5.0e-6
    output_usd_per_token: 1.5e-5
    rate_limit_rps: 50
instances:
  - {id: small-0, model: small, endpoint: "http://127.0.0.1:8001"}
  - {id: big-0, model: cloud-big}
tenants:
  - {tenant: acme, budget_usd: 10}
"""


def test_cluster_from_yaml_and_json(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(CLUSTER_YAML)
    cfg = ClusterConfig.from_file(p)
    assert cfg.model_of("small-0").scheduler.max_num_batched_tokens == 4096
    assert cfg.instance("big-0").model == "cloud-big"
    assert cfg.model("small").cost_usd(100, 10) == pytest.approx(1e-5 + 2e-6)
    j = tmp_path / "c.json"
    j.write_text(cfg.model_dump_json())
    assert ClusterConfig.from_file(j) == cfg


def test_cluster_rejects_unknown_model_and_duplicates(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(CLUSTER_YAML.replace("model: cloud-big}", "model: nope}"))
    with pytest.raises(ValidationError, match="names unknown model 'nope'"):
        ClusterConfig.from_file(p)
    p.write_text(CLUSTER_YAML.replace("id: big-0", "id: small-0"))
    with pytest.raises(ValidationError, match="instance ids must be unique"):
        ClusterConfig.from_file(p)


def test_an_instance_topic_of_its_own_is_refused() -> None:
    """Every room sends and reads an instance's queries on ``route.<id>``; a config naming
    another topic would have split the router from the worker, so it is refused."""
    data = {
        "models": [{"name": "m", "input_usd_per_token": 0, "output_usd_per_token": 0}],
        "instances": [{"id": "m-0", "model": "m", "topic": "mine"}],
    }
    with pytest.raises(ValidationError, match="topic"):
        ClusterConfig.model_validate(data)


def test_lookups_follow_a_copy_and_a_changed_copy_is_validated(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(CLUSTER_YAML)
    cfg = ClusterConfig.from_file(p)
    assert cfg.model_of("big-0") is cfg.model("cloud-big")
    with pytest.raises(KeyError, match="unknown instance 'x-0'; known: \\['small-0', 'big-0'\\]"):
        cfg.instance("x-0")
    moved = [i.model_copy(update={"model": "cloud-big"}) for i in cfg.instances]
    copy = cfg.model_copy(update={"instances": moved})
    assert copy.model_of("small-0").name == "cloud-big"
    assert cfg.model_of("small-0").name == "small"  # the original keeps its own
    assert cfg.model_copy(deep=True).model_of("small-0") == cfg.model_of("small-0")
    with pytest.raises(ValidationError, match="names unknown model 'nope'"):
        cfg.model_copy(update={"instances": [{"id": "n-0", "model": "nope"}]})


def test_resident_request_rules() -> None:
    with pytest.raises(ValidationError, match="prefilled_tokens .* must be <= prompt_tokens"):
        ResidentRequest(query_id="a", prompt_tokens=10, prefilled_tokens=11)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ResidentRequest(query_id="a", prompt_tokens=-1)
    with pytest.raises(ValidationError, match="decoded_tokens must be 0"):
        ResidentRequest(query_id="a", prompt_tokens=10, prefilled_tokens=5, decoded_tokens=1)


def test_snapshot_age() -> None:
    snap = InstanceSnapshot(instance_id="i", model="m", taken_at=100.0)
    assert snap.age_s(102.5) == 2.5 and snap.is_stale(102.5, 2.0) and not snap.is_stale(101, 2.0)


def test_dead_letter_keeps_raw_bytes() -> None:
    raw = b"\xff\x00 not json"
    dl = DeadLetter.of(raw, "message is not valid UTF-8", "queries", 3, 17, 1.0)
    back = DeadLetter.model_validate_json(dl.model_dump_json())
    assert back.raw() == raw and back.partition == 3 and back.offset == 17


def test_result_parse_error_names_field() -> None:
    with pytest.raises(BadMessage, match="result q1: ttft_ms must be >= 0, got -1"):
        parse_model(
            Result,
            json.dumps(
                {
                    "query_id": "q1",
                    "tenant": "t",
                    "instance_id": "i",
                    "model": "m",
                    "ttft_ms": -1,
                    "finished_at": 1,
                }
            ).encode(),
            what="result",
        )


def test_every_topic_body_exports_json_schema() -> None:
    for topic, model in TOPIC_BODIES.items():
        schema = model.model_json_schema()
        assert schema["type"] == "object", topic
        assert schema["properties"], topic


def test_dead_letter_of_a_huge_message_stays_small_and_names_it() -> None:
    raw = b"x" * 2_000_000
    dl = DeadLetter.of(raw, "message is 2000000 bytes, over the cap", "queries", 0, 5, 1.0)
    assert dl.truncated and dl.raw_size_bytes == 2_000_000 and len(dl.raw()) == 262_144
    assert len(dl.model_dump_json()) < 400_000
    import hashlib

    assert dl.raw_sha256 == hashlib.sha256(raw).hexdigest()


def test_routed_query_bytes_keep_the_query_as_received() -> None:
    from schemas import Decision, RoutedQuery, routed_query_bytes, routed_query_raw

    raw = b' {"id": "q1", "prompt": "say \\",\\"decision\\":", "ttft_slo_ms": 500}\n'
    d = Decision(query_id="q1", tenant="default", status="routed", instance_id="i1",
                 policy="p", decided_at=1.0, reason='a ,"decision": in the reason')  # fmt: skip
    body = routed_query_bytes(raw, d.model_dump_json(exclude_none=True).encode())
    rq = RoutedQuery.model_validate_json(body)
    assert rq.query.id == "q1" and rq.decision == d
    assert routed_query_raw(body, rq) == raw.strip()
    assert routed_query_raw(rq.model_dump_json().encode(), rq).startswith(b'{"id":"q1"')
