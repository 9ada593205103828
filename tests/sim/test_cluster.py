"""The simulated cluster: local engines with live state, cloud endpoints without (sim/cluster.py)."""

from __future__ import annotations

import pytest

from sim.cluster import ClusterError, SimCluster
from tests.sim.fakes import small_cluster


def _run(seed: int) -> list[tuple[str, str, float, float]]:
    c = SimCluster(small_cluster(), seed=seed)
    ids = c.instance_ids
    for k in range(40):
        c.advance_to(k * 0.05)
        c.submit(f"r{k}", ids[k % len(ids)], k * 0.05, 300 + 10 * k, 20 + k)
    done = c.drain()
    return (
        sorted((d.request_id, d.instance_id, d.first_token_s, d.finish_s) for d in c.completions)
        if done
        else []
    )


def test_every_request_completes_once_and_deterministically() -> None:
    a, b = _run(3), _run(3)
    assert a == b
    assert len(a) == 40 and len({r[0] for r in a}) == 40
    for _, _, first, finish in a:
        assert first <= finish
    assert _run(4) != a  # noise depends on the seed


def test_views_local_state_and_cloud_none() -> None:
    c = SimCluster(small_cluster(n_small=1, n_big=1))
    c.submit("a", "small-0", 0.0, 500, 50)
    c.submit("b", "api-0", 0.0, 500, 50)
    views = {v.instance_id: v for v in c.views()}
    assert views["small-0"].state is not None and views["small-0"].state.n == 1
    assert views["small-0"].free_slots == 31
    assert views["big-0"].state is not None and views["big-0"].state.n == 0
    assert views["api-0"].state is None and views["api-0"].free_slots == 7
    c.advance_to(1.0)
    assert c.views()[2].arrival_rate_per_s > 0


def test_cloud_rate_limit_and_concurrency_delay_first_tokens() -> None:
    c = SimCluster(small_cluster(n_small=1, n_big=0))
    for k in range(20):
        c.submit(f"r{k}", "api-0", 0.0, 200, 400)
    c.drain()
    firsts = sorted(x.first_token_s for x in c.completions)
    # 50 rps pacing: the 20th request enters service no earlier than 19/50 s
    assert firsts[-1] >= 19 / 50
    # only 8 in service at once: the 9th waits for a long (400-token) answer to finish
    assert firsts[8] > firsts[0] + 1.0
    assert all(x.first_token_s - x.arrival_s >= 0.15 for x in c.completions)  # network overhead


def test_errors_name_the_problem() -> None:
    c = SimCluster(small_cluster())
    with pytest.raises(ClusterError, match="unknown instance 'nope'"):
        c.submit("x", "nope", 0.0, 10, 10)
    c.submit("y", "small-0", 0.0, 10, 10)
    with pytest.raises(ClusterError, match="already submitted"):
        c.submit("y", "small-1", 0.0, 10, 10)
    c.advance_to(1.0)
    with pytest.raises(ClusterError, match="before the cluster clock"):
        c.advance_to(0.5)


def test_a_named_profile_comes_from_the_profiles_the_cluster_is_given() -> None:
    from loaders.profiles import read_profiles
    from sim.timing import TableTiming

    raw = small_cluster(n_small=1, n_big=0, cloud=False).model_dump()
    raw["models"][0]["step_time"] = None
    raw["models"][0]["profile"] = "llama-2-7b-hf@h100"
    named = type(small_cluster()).model_validate(raw)
    with pytest.raises(ClusterError, match="no step-time profiles were given"):
        SimCluster(named)  # sim/ reads no profiles file itself
    c = SimCluster(named, profiles=read_profiles())
    assert isinstance(c.engines["small-0"].timing, TableTiming)
