"""Pure pieces of the worker: offset commits, request bodies, engine metrics, synthetic output,
settings and topic names."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import Query, Result
from wiring import topics
from wiring.settings import Settings, SettingsError, redact_url
from workers import synth
from workers.backends.vllm import parse_engine_load, refit_cap, request_body
from workers.offsets import OffsetTracker
from workers.realtime import parse_coefficients
from workers.timings import RequestTiming, StepBatch, parse_report
from workers.worker import MAX_RESULT_BYTES, _result_bytes


def test_offsets_commit_only_past_finished_prefix() -> None:
    t: OffsetTracker[str] = OffsetTracker()
    for off in range(10, 15):
        t.started("p0", off)
    t.finished("p0", 11)
    t.finished("p0", 12)
    assert t.committable() == {"p0": 10}  # 10 is still running: nothing past it
    t.committed({"p0": 10})
    assert t.committable() == {}
    t.finished("p0", 10)
    assert t.committable() == {"p0": 13}
    for off in (13, 14):
        t.finished("p0", off)
    assert t.committable() == {"p0": 15}
    t.forget(["p0"])
    assert t.committable() == {}


def test_a_refetched_copy_finishing_does_not_release_the_running_one() -> None:
    """After a group re-join the same offset is fetched again while its first copy runs;
    the copy is skipped as a duplicate, but the offset stays held until the first ends."""
    t: OffsetTracker[str] = OffsetTracker()
    for off in (5, 6):
        t.started("p0", off)
    t.started("p0", 5)  # re-fetched
    t.finished("p0", 6)
    t.finished("p0", 5)  # the skipped copy
    assert t.committable() == {"p0": 5} and t.unfinished() == 1
    t.finished("p0", 5)  # the first copy published its result
    assert t.committable() == {"p0": 7} and t.unfinished() == 0


@given(st.permutations(list(range(30))), st.integers(min_value=0, max_value=30))
def test_offsets_never_commit_an_unfinished_message(order: list[int], n_done: int) -> None:
    t: OffsetTracker[int] = OffsetTracker()
    for off in range(30):
        t.started(0, off)
    done = set(order[:n_done])
    for off in done:
        t.finished(0, off)
    commit = t.committable().get(0, 0)
    assert all(off in done for off in range(commit))
    assert commit == 30 or commit not in done


def test_request_body_completion_and_chat() -> None:
    q = Query(id="a", prompt="hi", max_tokens=5, temperature=0.2, stop=["\n"], seed=3)
    path, body = request_body(q, "m")
    assert path == "/v1/completions"
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": "hi",
        "max_tokens": 5,
        "temperature": 0.2,
        "stop": ["\n"],
        "seed": 3,
    }
    c = Query(id="b", messages=[{"role": "user", "content": "yo"}], max_completion_tokens=9)
    path, body = request_body(c, "m")
    assert path == "/v1/chat/completions"
    assert (
        body["messages"] == [{"role": "user", "content": "yo"}]
        and body["max_completion_tokens"] == 9
    )
    assert "max_tokens" not in body and "prompt" not in body


def test_engine_load_from_vllm_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m"} 7.0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        "vllm:num_requests_swapped 1.0\n"
    )
    load = parse_engine_load(text)
    assert (load.running, load.waiting, load.kv_usage) == (5, 7, 0.25)
    assert parse_engine_load("").running is None


def test_synthetic_output_is_deterministic() -> None:
    assert synth.output_tokens(17, "x") == 17
    a = synth.output_tokens(None, "some prompt", mean_tokens=100)
    assert a == synth.output_tokens(None, "some prompt", mean_tokens=100) and a >= 1
    draws = [synth.output_tokens(None, f"p{i}", mean_tokens=100) for i in range(2000)]
    assert 80 < sum(draws) / len(draws) < 120
    assert synth.tokens_text("s", 0, 3) == synth.tokens_text("s", 0, 2) + synth.token_text("s", 2)


def test_coefficients_parse_with_clear_errors() -> None:
    c = parse_coefficients("1, 0.5, 0, 1e-6")
    assert (c.c0_ms, c.c3_ms_per_attn_unit) == (1.0, 1e-6)
    with pytest.raises(ValueError, match="four numbers"):
        parse_coefficients("1,2")
    with pytest.raises(ValueError, match="must be numbers"):
        parse_coefficients("a,b,c,d")


def test_timing_reports_round_trip() -> None:
    s = StepBatch(
        instance_id="i",
        model="m",
        at=1.0,
        n_tokens=[1.0],
        decode_ctx_tokens=[2.0],
        prefill_attn_units=[0.0],
        duration_ms=[3.0],
    )
    assert parse_report(s.model_dump_json().encode()) == s
    r = RequestTiming(
        instance_id="i",
        model="m",
        query_id="q",
        at=1.0,
        prompt_tokens=3,
        output_tokens=2,
        engine_ttft_ms=1.0,
        engine_e2e_ms=2.0,
        residents_ahead=0,
        backend="vllm",
    )
    assert parse_report(r.model_dump_json().encode()) == r


def test_huge_result_text_is_cut_to_fit_one_message() -> None:
    r = Result(
        query_id="q", tenant="t", instance_id="i", model="m", text="é" * 1_000_000, finished_at=1.0
    )
    body = _result_bytes(r)
    assert len(body) <= MAX_RESULT_BYTES
    cut = Result.model_validate_json(body)
    assert "[truncated" in cut.text and cut.query_id == "q"


def test_settings_from_env_secrets_and_errors() -> None:
    env = {
        "SWITCHYARD_KAFKA": "h1:9092, h2:9093",
        "SWITCHYARD_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SWITCHYARD_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "SWITCHYARD_KAFKA_SASL_USERNAME": "svc",
        "SWITCHYARD_KAFKA_SASL_PASSWORD": "kafka-secret",
        "SWITCHYARD_REDIS": "rediss://redis.example:6380/0",
        "SWITCHYARD_REDIS_PASSWORD": "redis-secret",
        "SWITCHYARD_NAMESPACE": "prod",
    }
    s = Settings.from_env(env)
    assert (
        "kafka-secret" not in repr(s)
        and "redis-secret" not in repr(s)
        and "redis-secret" not in str(s)
    )
    kw = s.kafka_kwargs(client_id="c")
    assert (
        kw["bootstrap_servers"] == "h1:9092,h2:9093" and kw["sasl_plain_password"] == "kafka-secret"
    )
    assert kw["sasl_mechanism"] == "SCRAM-SHA-512" and kw["ssl_context"] is not None
    assert s.redis_kwargs() == {
        "url": "rediss://redis.example:6380/0",
        "password": "redis-secret",
        "tls_ca_file": None,
        "namespace": "prod",
    }
    assert s.faust_broker() == "kafka://h1:9092;h2:9093"
    plain = Settings.from_env({})
    assert plain.kafka_kwargs() == {
        "bootstrap_servers": "127.0.0.1:19092",
        "security_protocol": "PLAINTEXT",
    }
    with pytest.raises(
        SettingsError, match="SWITCHYARD_KAFKA_SASL_USERNAME and SWITCHYARD_KAFKA_SASL_PASSWORD"
    ):
        Settings.from_env({"SWITCHYARD_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    with pytest.raises(SettingsError, match="SWITCHYARD_REDIS: must be a redis://"):
        Settings.from_env({"SWITCHYARD_REDIS": "http://x"})
    with pytest.raises(SettingsError) as info:
        Settings.from_env(
            {
                "SWITCHYARD_KAFKA_SECURITY_PROTOCOL": "bogus",
                "SWITCHYARD_KAFKA_SASL_PASSWORD": "leak-me",
            }
        )
    assert "leak-me" not in str(info.value)
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_topic_names() -> None:
    assert topics.route("gpu-1") == "route.gpu-1"
    assert topics.instance_of("route.gpu-1") == "gpu-1" and topics.instance_of("results") is None
    assert topics.worker_group("gpu-1") == "worker.gpu-1"
    with pytest.raises(ValueError, match="instance id 'a b' must match"):
        topics.route("a b")


async def test_realtime_engine_streams_every_request_to_completion() -> None:
    from schemas import SchedulerConfig, StepTimeCoefficients
    from workers.realtime import RealtimeEngine, make_timing

    coef = StepTimeCoefficients(
        c0_ms=1.0, c1_ms_per_token=0.001, c2_ms_per_ctx_token=0.0, c3_ms_per_attn_unit=0.0
    )
    eng = RealtimeEngine(
        make_timing(coefficients=coef), SchedulerConfig(max_num_batched_tokens=128), time_scale=20.0
    )
    await eng.start()
    try:
        specs = [(300, 12), (50, 1), (1000, 30)]

        async def one(prompt: int, out: int) -> list[tuple[str, int, int]]:
            return [
                (ev.kind, ev.tokens, ev.prefilled_tokens) async for ev in eng.submit(prompt, out)
            ]

        runs = await asyncio.gather(*(one(p, o) for p, o in specs))
    finally:
        await eng.stop()
    for (prompt, out), evs in zip(specs, runs, strict=True):
        assert evs[-1] == ("finished", out, prompt)
        tokens = [t for k, t, _ in evs if k != "prefill"]
        assert tokens == sorted(tokens) and tokens[0] == 1
        prefills = [f for k, _, f in evs if k == "prefill"]
        assert all(0 < f < prompt for f in prefills) and prefills == sorted(prefills)
    assert eng.n_running == 0 and eng.n_waiting == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, 0.05, 301.0, float("nan")])
def test_worker_config_rejects_a_bad_metadata_refresh(bad: float) -> None:
    from workers.worker import WorkerConfig

    with pytest.raises(ValueError, match="metadata_refresh_s"):
        WorkerConfig(instance_id="x", metadata_refresh_s=bad)
    assert WorkerConfig(instance_id="x").metadata_refresh_s == 5.0


async def test_sim_backend_answers_a_prompt_beyond_its_context_with_an_error() -> None:
    """The engine refuses it (as vLLM does with HTTP 400) and keeps serving the others."""
    from schemas import ModelSpec
    from workers.backends.base import GenerationRequest
    from workers.backends.sim import SimBackend

    spec = ModelSpec.model_validate(
        {
            "name": "m",
            "input_usd_per_token": 0.0,
            "output_usd_per_token": 0.0,
            "max_model_len": 4_096,
            "step_time": {"c0_ms": 1.0, "c1_ms_per_token": 1e-4, "c2_ms_per_ctx_token": 0.0,
                          "c3_ms_per_attn_unit": 0.0},
        }
    )  # fmt: skip
    backend = SimBackend(spec, instance_id="i", time_scale=50.0)
    await backend.start()
    try:
        big, small = (
            GenerationRequest(Query(id=qid, prompt="x", max_tokens=4), qid, p, 4)
            for qid, p in (("big", 4_096), ("small", 100))
        )
        got_big, got_small = await asyncio.gather(
            backend.generate(big, lambda *_: None), backend.generate(small, lambda *_: None)
        )
    finally:
        await backend.close()
    assert got_big.error and "prompt of 4096 tokens" in got_big.error
    assert "context of 4096 tokens" in got_big.error
    assert got_small.error is None and got_small.output_tokens == 4


def test_prefix_counters_from_real_vllm_metrics_and_the_reconciler() -> None:
    from pathlib import Path

    from workers.prefix_reconcile import PrefixReconciler, parse_prefix_counters

    sample = Path(__file__).resolve().parents[2].parent / "shared" / "vllm" / "metrics_sample.txt"
    if sample.exists():  # a real vLLM 0.32 /metrics page (../shared)
        assert parse_prefix_counters(sample.read_text()) == (29.0, 0.0)
    page = (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 1000.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 500.0\n'
    )
    assert parse_prefix_counters(page) == (2000.0, 500.0)
    assert parse_prefix_counters("vllm:num_requests_running 3\n") is None
    rec = PrefixReconciler(capacity_tokens=100_000.0, max_tokens=100_000.0)
    assert rec.scrape((0.0, 0.0)) is None  # the first scrape only sets the baseline
    rec.served(40_000.0)  # the model predicted 40k cached tokens ...
    new = rec.scrape((60_000.0, 10_000.0))  # ... the engine found 10k
    assert new == 50_000.0 and rec.capacity_tokens == 50_000.0  # halved (the most per step)
    assert rec.engine_hit_rate == pytest.approx(1 / 6)
    rec.served(5_000.0)
    assert rec.scrape((70_000.0, 15_000.0)) is None  # as predicted: unchanged
    assert rec.scrape((10.0, 0.0)) is None  # counters went down: engine restarted


def test_refit_cap_reads_both_vllm_context_messages() -> None:
    old = ("This model's maximum context length is 2048 tokens. However, you requested 2100 "
           "tokens (1500 in the messages, 600 in the completion).")  # fmt: skip
    new = ("'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum "
           "context length is 2048 tokens and your request has 1700 input tokens "
           "(4096 > 2048 - 1700).")  # fmt: skip
    assert refit_cap(old) == 548
    assert refit_cap(new) == 348
    assert refit_cap("This model's maximum context length is 2048 tokens. However, your "
                     "request has 2048 input tokens.") is None  # fmt: skip
    assert refit_cap("HTTP 500: boom") is None


def test_the_default_cap_sent_is_cut_to_the_context() -> None:
    from schemas import ModelSpec

    spec = ModelSpec(name="m", input_usd_per_token=0, output_usd_per_token=0, max_model_len=2048)
    q = Query(id="q", prompt="x" * 6000)  # ~1,500 tokens by the 4-bytes estimate
    cap = spec.output_cap_tokens(q, q.estimated_prompt_tokens())
    assert cap == 2048 - 1500
    _, body = request_body(q, "m", cap)
    assert body["max_tokens"] == 548
    _, body = request_body(q.model_copy(update={"max_tokens": 7}), "m", cap)
    assert body["max_tokens"] == 7


def test_every_shipped_cluster_names_max_model_len_on_every_model() -> None:
    from pathlib import Path

    from schemas import ClusterConfig

    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("clusters/*.yaml")) + [root / "demo-cluster.yaml"]
    assert len(files) >= 6
    for f in files:
        missing = [m.name for m in ClusterConfig.from_file(f).models if m.max_model_len is None]
        assert not missing, f"{f.name}: no max_model_len on {missing}"
