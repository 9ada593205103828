"""``state.prefix.touch_of``: what a router (routed) or a worker (finished) touches in an
instance's prefix-cache model: the prompt's whole blocks only, on local models only."""

from __future__ import annotations

from schemas import ClusterConfig, Query
from state.prefix import touch_of

CLUSTER = ClusterConfig.model_validate(
    {
        "models": [
            {"name": "m", "input_usd_per_token": 1e-7, "output_usd_per_token": 1e-7,
             "scheduler": {"kv_blocks": 100, "block_size_tokens": 16}},
            {"name": "api", "kind": "cloud", "input_usd_per_token": 1e-6,
             "output_usd_per_token": 1e-6},
        ],  # fmt: skip
        "instances": [{"id": "m-0", "model": "m"}, {"id": "api-0", "model": "api"}],
    }
)


def query(prompt_tokens: int, hashes: list[int] | None = None) -> Query:
    return Query(id="q", prompt="x " * 3000, prompt_tokens=prompt_tokens, prefix_hashes=hashes,
                 prefix_block_tokens=512)  # fmt: skip


def test_whole_blocks_on_local_models_only() -> None:
    t = touch_of("m-0", query(3 * 512 + 200, [5, 6, 7, 8]), CLUSTER.model("m"))
    assert t is not None and list(t.hashes) == [5, 6, 7]  # the 4th block is not whole
    assert t.block_tokens == 512.0 and t.capacity_tokens == 1600.0
    assert touch_of("api-0", query(3 * 512 + 200, [5, 6, 7, 8]), CLUSTER.model("api")) is None
    assert touch_of("m-0", query(500, [5]), CLUSTER.model("m")) is None  # under one block
    derived = touch_of("m-0", query(1500), CLUSTER.model("m"))  # hashes from the text
    assert derived is not None and len(derived.hashes) >= 1
