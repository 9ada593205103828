"""Offline instance allocation: GPU budget, brute force, bad inputs, CLI."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from routing.allocation import (
    AllocationProblem,
    evaluate_allocation,
    solve_allocation,
    uniform_allocation,
)


def problem(seed: int = 0, budget: float | None = None, gpus: int = 6) -> AllocationProblem:
    rng = np.random.default_rng(seed)
    n, m = 60, 3
    scores = np.clip(rng.normal([0.4, 0.6, 0.8], 0.2, (n, m)), 0, 1)
    cost = np.tile([1e-4, 5e-4, 2e-3], (n, 1))
    return AllocationProblem(
        scores,
        cost,
        gpus_per_instance=np.array([1, 2, 4]),
        slots_per_instance=np.array([4, 4, 4]),
        gpu_budget=gpus,
        window_size=12,
        n_windows=4,
        window_budget_usd=budget,
        seed=seed,
    )


@pytest.mark.parametrize(("seed", "budget", "gpus"), [(0, None, 6), (1, 0.006, 8), (2, None, 3)])
def test_allocation_matches_brute_force_and_respects_the_gpu_budget(
    seed: int, budget: float | None, gpus: int
) -> None:
    p = problem(seed, budget, gpus)
    best = -1.0
    for counts in itertools.product(range(0, gpus + 1), repeat=3):
        c = np.array(counts)
        if (c * p.gpus_per_instance).sum() <= gpus:
            best = max(best, evaluate_allocation(p, c))
    alloc = solve_allocation(p)
    assert alloc.gpus_used <= gpus
    assert alloc.expected_quality == pytest.approx(best, abs=1e-6)
    assert alloc.expected_quality >= evaluate_allocation(p, uniform_allocation(p)) - 1e-9


def test_cloud_models_need_no_instances() -> None:
    p = problem()
    cloud = AllocationProblem(
        p.scores, p.cost_usd, np.array([1, 2, 0]), np.array([4, 4, 0]), 2, 12, 4
    )
    alloc = solve_allocation(cloud)
    assert alloc.instances[2] == 0 and alloc.gpus_used <= 2
    # the cloud model serves anything left: every query is served
    assert alloc.expected_quality >= evaluate_allocation(cloud, np.zeros(3, dtype=np.int64))


def test_given_window_rows_are_the_sampled_windows_when_equal() -> None:
    p = problem(seed=3)
    given = AllocationProblem(
        p.scores,
        p.cost_usd,
        p.gpus_per_instance,
        p.slots_per_instance,
        p.gpu_budget,
        window_rows=p.windows(),
    )
    assert np.array_equal(given.windows(), p.windows())
    a, b = solve_allocation(p), solve_allocation(given)
    assert a.expected_quality == pytest.approx(b.expected_quality, abs=1e-9)


def test_serve_first_serves_more_queries_before_quality() -> None:
    # one GPU: a sharp model that takes 1 query per window, or a weak one that takes 10
    n = 10
    scores = np.tile([1.0, 0.05], (n, 1))
    base = {
        "scores": scores,
        "cost_usd": np.zeros((n, 2)),
        "gpus_per_instance": np.array([1, 1]),
        "slots_per_instance": np.array([1, 10]),
        "gpu_budget": 1,
        "window_rows": np.arange(n)[None, :],
    }
    quality_first = solve_allocation(AllocationProblem(**base))  # type: ignore[arg-type]
    assert quality_first.instances.tolist() == [1, 0]
    assert quality_first.expected_quality == pytest.approx(0.1)
    served_first = solve_allocation(AllocationProblem(**base, serve_first=True))  # type: ignore[arg-type]
    assert served_first.instances.tolist() == [0, 1]
    assert served_first.expected_quality == pytest.approx(0.05)  # unshifted mean score
    assert np.isnan(served_first.bound) and np.isnan(served_first.gap)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scores": np.full((2, 3), np.nan)}, r"scores\[0, 0\] is nan"),
        ({"cost_usd": -np.ones((60, 3))}, r"cost_usd\[0, 0\] is -1.0"),
        ({"gpus_per_instance": np.array([1, -1, 1])}, "gpus_per_instance must be >= 0"),
        ({"gpu_budget": -1}, "gpu_budget must be >= 0"),
        ({"window_budget_usd": float("nan")}, "window_budget_usd must be >= 0"),
        ({"window_rows": np.array([[0, 60]])}, r"window_rows must index the 60 queries"),
        ({"window_rows": np.zeros((2, 2))}, "window_rows must be a non-empty .* integer array"),
    ],
)
def test_bad_inputs_are_named(change: dict[str, object], message: str) -> None:
    p = problem()
    kwargs = {
        "scores": p.scores,
        "cost_usd": p.cost_usd,
        "gpus_per_instance": p.gpus_per_instance,
        "slots_per_instance": p.slots_per_instance,
        "gpu_budget": p.gpu_budget,
        "window_budget_usd": p.window_budget_usd,
        "window_rows": p.window_rows,
    }
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        AllocationProblem(**kwargs)  # type: ignore[arg-type]


def test_allocate_cli_prints_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from switchyard.cli import app

    rng = np.random.default_rng(0)
    models = ["a", "b", "c"]
    lines = ["query_id,text,model,score"]
    for i in range(40):
        for j, mname in enumerate(models):
            lines.append(f"q{i},question {i},{mname},{float(rng.random() < 0.3 + 0.25 * j):.1f}")
    data = tmp_path / "scores.csv"
    data.write_text("\n".join(lines) + "\n")
    prices = tmp_path / "models.csv"
    prices.write_text(
        "model,input_usd_per_token,output_usd_per_token\na,1e-8,1e-8\nb,1e-7,1e-7\nc,1e-6,1e-6\n"
    )
    result = CliRunner().invoke(
        app,
        [
            "allocate",
            "--gpus",
            "4",
            "--data",
            str(data),
            "--format",
            "long",
            "--models-csv",
            str(prices),
            "--gpus-per-instance",
            "a=1,b=1,c=2",
            "--slots-per-instance",
            "4",
            "--window",
            "10",
            "--windows",
            "3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out["instances"]) == set(models)
    assert out["gpus_used"] <= 4
    assert out["expected_quality"] >= out["fixed_allocation"]["expected_quality"] - 1e-9


def test_allocate_cli_rejects_a_bad_gpu_map(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from switchyard.cli import app

    result = CliRunner().invoke(
        app,
        [
            "allocate",
            "--gpus",
            "4",
            "--data",
            str(tmp_path / "none.csv"),
            "--gpus-per-instance",
            "a=x",
        ],
    )
    assert result.exit_code != 0
    assert "gpus-per-instance" in result.output
