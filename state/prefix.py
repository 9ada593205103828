"""Each instance's prefix-cache model in Redis (issue 14, "per-instance cache state").

The same rules as the simulator's ``routing.prefix.LruPrefixModel`` (one Lua script,
``lua/prefix_touch.lua``, so several routers and workers can touch it at once): a query's
whole prefix blocks are touched on the instance it is routed to and again when it finishes
there, tail first (its first block the most recent: vLLM evicts a prompt's tail before its
head); the least recently touched blocks go once their tokens exceed the capacity (the
instance's KV cache, resized by the worker when vLLM's own ``prefix_cache_hits_total``
disagrees). Memory is bounded by that capacity: at most capacity / block tokens members
per instance (≈ 500 for a 128k-token cache and 256-token blocks).

The router reads every instance's model in the snapshot it takes each window
(``state.liveness``: ``InstanceLive.prefix_hashes``) and touches what it routed
(``RedisPrefix.prefix_touch_many``, one pipelined call per window); a worker touches what
finished on its instance (``workers.worker``). A vLLM instance's worker also compares the
model's predictions (``Decision.predicted_cached_tokens``) with the engine's own
``prefix_cache_hits_total`` (``workers.prefix_reconcile``) and, when they disagree, stores a
new capacity with its next touch (``PrefixTouch.set_capacity``); from then on every touch,
the routers' included, evicts down to the stored capacity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from schemas import ModelSpec, Query
from schemas.prefix import full_blocks
from state.keys import Keys
from state.records import PrefixTouch as PrefixTouch  # re-exported: touches are built here
from state.redis_core import RedisCore

KEEP_S = 3600.0
"""An instance's model expires an hour after its last touch (an instance gone for good)."""


def kv_cache_tokens(spec: ModelSpec) -> float:
    """An instance's configured KV-cache tokens: its prefix model's capacity by default."""
    return float(spec.scheduler.kv_blocks * spec.scheduler.block_size_tokens)


def touch_of(
    instance_id: str, q: Query, spec: ModelSpec, reconciled_tokens: float | None = None
) -> PrefixTouch | None:
    """The touch of ``q``'s whole prefix blocks on ``instance_id`` (an instance of ``spec``),
    its model's capacity that instance's KV-cache tokens, or ``reconciled_tokens`` (stored
    in the model: ``PrefixTouch.set_capacity``) when a worker has reconciled it with the
    engine; None for a cloud model (no cache of ours) or a prompt shorter than one block."""
    if spec.kind != "local":
        return None
    hashes, block_tokens = q.prefix_identity  # once per query (``Query.prefix_blocks``)
    n = full_blocks(len(hashes), q.estimated_prompt_tokens(), block_tokens)
    if n <= 0:
        return None
    if reconciled_tokens is not None:
        return PrefixTouch(instance_id, hashes[:n], block_tokens, reconciled_tokens, True)
    return PrefixTouch(instance_id, hashes[:n], block_tokens, kv_cache_tokens(spec))


class PrefixCacheState:
    """Touch and read instances' prefix-cache models, one pipelined round trip each way."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._r = client
        self.keys = keys
        text = resources.files("state").joinpath("lua", "prefix_touch.lua").read_text("utf-8")
        self._touch = client.register_script(text)

    async def touch_many(self, touches: Sequence[PrefixTouch]) -> list[int]:
        """Apply every touch in order (one pipeline); how many blocks each evicted."""
        if not touches:
            return []
        calls: list[list[Any]] = []
        for t in touches:
            if not t.block_tokens > 0 or not t.capacity_tokens > 0:
                raise ValueError(
                    f"prefix touch on {t.instance_id}: block_tokens and capacity_tokens must be "
                    f"> 0, got {t.block_tokens} and {t.capacity_tokens}"
                )
            calls.append([*self.keys.prefix(t.instance_id), repr(float(t.capacity_tokens)),
                          repr(float(t.block_tokens)), int(KEEP_S * 1000),
                          "1" if t.set_capacity else "0",
                          *(str(int(h)) for h in t.hashes)])  # fmt: skip
        for attempt in (0, 1):
            pipe = self._r.pipeline(transaction=False)
            for call in calls:
                # raw EVALSHA: a cluster pipeline routes it by its first key (see StateStore)
                pipe.execute_command("EVALSHA", self._touch.sha, 2, *call)
            try:
                return [int(x) for x in await pipe.execute()]
            except NoScriptError:
                if attempt:
                    raise
                await self._r.script_load(self._touch.script)
        raise AssertionError("unreachable")

    async def cached_many(self, instance_ids: Sequence[str]) -> Mapping[str, list[int]]:
        """Every instance's modelled cached hashes, least recent first (one pipeline)."""
        pipe = self._r.pipeline(transaction=False)
        for iid in instance_ids:
            pipe.zrange(self.keys.prefix(iid)[0], 0, -1)
        got = cast(list[list[str]], await pipe.execute())
        return {iid: [int(h) for h in members] for iid, members in zip(instance_ids, got, strict=True)}


class RedisPrefix(RedisCore):
    """The store's side of the prefix-cache models (``state.protocols.PrefixModel``)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, display_url: str) -> None:
        super().__init__(client, keys, display_url)
        self._prefix_state = PrefixCacheState(client, keys)

    async def prefix_touch_many(self, touches: Sequence[PrefixTouch]) -> list[int]:
        """``PrefixCacheState.touch_many`` on the store's client (one pipelined call)."""
        if not touches:
            return []
        return await self._call("prefix_touch", self._prefix_state.touch_many(touches))
