"""The per-copy claim (``state/lua/claim.lua``) against the real Redis: a worker about to run
a query and a rescuer re-routing it from a silent instance; exactly one of them wins."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator

import pytest

from state import StateStore

pytestmark = pytest.mark.integration


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[list[StateStore]]:
    ns = "c" + uuid.uuid4().hex[:12]
    opened = [await StateStore.connect(redis_url, namespace=ns) for _ in range(4)]
    yield opened
    for s in opened:
        await s.close()


async def test_worker_first_then_rescuer_loses(stores: list[StateStore]) -> None:
    w, r = stores[0], stores[1]
    assert await w.claim_run("i", "q1") == "won"
    assert await w.claim_run("i", "q1") == "won"  # the same instance again: a re-delivery
    assert await r.claim_rescue("i", ["q1"], "r1", lease_s=30) == ["lost"]
    assert await w.claim_state("i", "q1") == "run"


async def test_rescuer_first_then_worker_waits_then_loses_for_good(
    stores: list[StateStore],
) -> None:
    w, r = stores[0], stores[1]
    assert await r.claim_rescue("i", ["q1", "q2"], "r1", lease_s=30) == ["won", "won"]
    assert await w.claim_run("i", "q1") == "wait"  # leased, not re-routed yet
    assert await r.claim_rescue("i", ["q1"], "r2", lease_s=30) == ["busy"]  # another rescuer
    assert await r.claim_rescue("i", ["q1"], "r1", lease_s=30) == ["won"]  # renewal
    assert await r.claim_rerouted("i", ["q1"], "r1") == ["won"]
    assert await w.claim_run("i", "q1") == "lost"
    assert await r.claim_rescue("i", ["q1"], "r2", lease_s=30) == ["lost"]
    assert await r.claim_rerouted("i", ["q1"], "r2") == ["lost"]  # not its claim
    state = await w.claim_state("i", "q1")
    assert state is not None and state.startswith("rerouted r1")
    # the claim is per instance: the re-routed copy on another instance is claimed afresh
    assert await w.claim_run("j", "q1") == "won"


async def test_lapsed_lease_goes_to_the_worker_or_a_successor(stores: list[StateStore]) -> None:
    w, r = stores[0], stores[1]
    assert await r.claim_rescue("i", ["a", "b"], "dead", lease_s=0.05) == ["won", "won"]
    await asyncio.sleep(0.15)
    assert await w.claim_run("i", "a") == "won"  # the instance came back: it runs the copy
    assert await r.claim_rescue("i", ["a", "b"], "next", lease_s=30) == ["lost", "won"]
    assert await r.claim_rerouted("i", ["a"], "dead") == ["lost"]  # too late: worker runs it


async def test_a_copy_routed_back_to_its_instance_returns_the_claim_to_the_worker(
    stores: list[StateStore],
) -> None:
    w, r = stores[0], stores[1]
    assert await r.claim_rescue("i", ["q1", "q2"], "r1", lease_s=30) == ["won", "won"]
    assert await w.claim_run("i", "q1") == "wait"
    assert await r.claim_returned("i", ["q1"], "r2") == ["lost"]  # not its claim: kept
    assert await r.claim_returned("i", ["q1"], "r1") == ["won"]
    assert await w.claim_state("i", "q1") is None  # dropped: the worker runs a copy
    assert await w.claim_run("i", "q1") == "won"
    assert await r.claim_returned("i", ["q1"], "r1") == ["lost"]  # its worker runs it now
    assert await r.claim_rescue("i", ["q2"], "r1", lease_s=0.05) == ["won"]
    await asyncio.sleep(0.15)
    assert await w.claim_run("i", "q2") == "won"  # the lease lapsed: the worker took it
    assert await r.claim_returned("i", ["q2"], "r1") == ["lost"]
    assert await w.claim_state("i", "q2") == "run"


async def test_concurrent_worker_and_rescuers_exactly_one_wins(stores: list[StateStore]) -> None:
    ids = [f"q{n}" for n in range(200)]

    async def worker() -> dict[str, str]:
        got = await asyncio.gather(*(stores[0].claim_run("i", q) for q in ids))
        return dict(zip(ids, got, strict=True))

    async def rescuer(s: StateStore, name: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for n in range(0, len(ids), 7):
            chunk = ids[n : n + 7]
            got = await s.claim_rescue("i", chunk, name, lease_s=30)
            out.update(zip(chunk, got, strict=True))
        return out

    w, r1, r2 = await asyncio.gather(worker(), rescuer(stores[1], "r1"), rescuer(stores[2], "r2"))
    for q in ids:
        winners = [who for who, got in (("w", w[q]), ("r1", r1[q]), ("r2", r2[q])) if got == "won"]
        assert len(winners) == 1, f"{q}: {winners} won ({w[q]}, {r1[q]}, {r2[q]})"
        if winners != ["w"]:
            assert w[q] == "wait"


async def test_claims_expire_and_bad_input_is_named(stores: list[StateStore]) -> None:
    s = stores[0]
    assert await s.claim_run("i", "q", ttl_s=0.05) == "won"
    await asyncio.sleep(0.15)
    assert await s.claim_state("i", "q") is None
    with pytest.raises(ValueError, match="query id 'bad id'"):
        await s.claim_run("i", "bad id")
    with pytest.raises(ValueError, match="instance id"):
        await s.claim_run("bad/inst", "q")
    with pytest.raises(ValueError, match="rescuer id"):
        await s.claim_rescue("i", ["q"], "two words", lease_s=1)
    with pytest.raises(ValueError, match="claim lease_s"):
        await s.claim_rescue("i", ["q"], "r", lease_s=0)
    assert await s.claim_rescue("i", [], "r", lease_s=1) == []


async def test_claim_keys_share_the_instance_hash_tag(stores: list[StateStore]) -> None:
    k = stores[0].keys
    keys = [k.claim("gpu-a", f"q{n}") for n in range(5)] + [k.slots("gpu-a")]
    tags = {m.group(1) for key in keys if (m := re.search(r"\{([^}]+)\}", key))}
    assert tags == {"gpu-a"}


async def test_has_results_in_one_round_trip(stores: list[StateStore]) -> None:
    s = stores[0]
    await s.mark_result("x", 60, cost_usd=0.1)
    assert await s.has_results(["x", "y"]) == [True, False]
    assert await s.has_results([]) == []
