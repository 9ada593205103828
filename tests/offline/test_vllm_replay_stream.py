"""``offline.vllm_replay.replay`` over a real HTTP stream (the project's fake vLLM server): one
record per request, TTFT and tokens read through ``wiring.sse``, an HTTP error recorded, not raised."""

from __future__ import annotations

import math

from offline.vllm_replay import ReplayRequest, replay
from schemas import StepTimeCoefficients
from workers.fake_vllm import FakeVllmConfig, build_server, start_server

COEF = StepTimeCoefficients(
    c0_ms=2.0, c1_ms_per_token=0.01, c2_ms_per_ctx_token=0.0, c3_ms_per_attn_unit=0.0
)


async def test_replay_records_every_request_from_the_stream() -> None:
    server = await start_server(
        build_server(
            coefficients=COEF, time_scale=4.0, config=FakeVllmConfig(model="m", max_model_len=512)
        )
    )
    try:
        requests = [
            ReplayRequest("a", 0.0, 20, 5),
            ReplayRequest("b", 0.01, 40, 3),
            ReplayRequest("too-long", 0.02, 600, 3),  # over max_model_len: the server's 400
        ]
        records = await replay(server.url, "m", requests, vocab_size=256, timeout_s=30.0)
    finally:
        await server.stop()
    by_id = {r.request_id: r for r in records}
    assert [r.request_id for r in records] == ["a", "b", "too-long"]
    for rid, want in (("a", 5), ("b", 3)):
        rec = by_id[rid]
        assert rec.error == "" and rec.generated_tokens == want
        assert 0.0 < rec.ttft_s <= rec.e2e_s
    bad = by_id["too-long"]
    assert bad.error.startswith("HTTP 400") and math.isnan(bad.ttft_s)
