"""The ILP's TTFT cuts (``routing.ilp.ttft_cuts``): checks that stop at the first violator,
and checks not run twice, give the loop the answer that full checks give."""

from __future__ import annotations

import numpy as np
import pytest

from routing.ilp import BatchProblem, solve
from routing.ilp.ttft_cuts import prune_by_standalone, solve_with_ttft_cuts
from routing.sfs import estimate_ttft_ms, standalone_ttft_ms
from routing.steptime import StepTimeModel
from routing.types import InstanceState
from schemas import SchedulerConfig

M = StepTimeModel(
    c0_ms=5.0, c1_ms_per_token=0.02, c2_ms_per_ctx_token=1e-4, c3_ms_per_attn_unit=1e-6
)
SCHED = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=24)


@pytest.mark.parametrize("seed", range(12))
def test_bounded_and_cached_checks_give_the_full_checks_answer(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(20, 90)), int(rng.integers(2, 5))
    prompts = rng.integers(1, 1500, n)
    outs = rng.integers(1, 300, n)
    slo = rng.uniform(150.0, 2500.0, n)
    state = InstanceState.empty()
    standalone = np.stack(
        [standalone_ttft_ms(state, prompts, M, SCHED) * (1 + 0.3 * j) for j in range(k)], axis=1
    )
    feasible, none = prune_by_standalone(np.ones((n, k), dtype=np.bool_), standalone, slo)
    problem = BatchProblem(
        utility=rng.uniform(0.2, 1.0, (n, k)),
        cost_usd=rng.uniform(0.0, 1e-3, (n, k)),
        capacity=np.full(k, n),
        feasible=feasible,
    )
    calls: dict[str, list[tuple[int, bytes, bytes]]] = {"full": [], "bounded": []}

    def check(name: str, honour: bool):  # type: ignore[no-untyped-def]
        def in_order(j: int, rows: np.ndarray, over_ms: np.ndarray | None) -> np.ndarray:
            calls[name].append((j, rows.tobytes(), b"" if over_ms is None else over_ms.tobytes()))
            t: np.ndarray = estimate_ttft_ms(
                state,
                prompts[rows],
                StepTimeModel(
                    c0_ms=M.c0_ms * (1 + 0.3 * j),
                    c1_ms_per_token=M.c1_ms_per_token * (1 + 0.3 * j),
                    c2_ms_per_ctx_token=M.c2_ms_per_ctx_token * (1 + 0.3 * j),
                    c3_ms_per_attn_unit=M.c3_ms_per_attn_unit * (1 + 0.3 * j),
                ),
                SCHED,
                outs[rows],
                over_ms=over_ms if honour else None,
            )
            return t

        return in_order

    got = {}
    for name, honour in (("full", False), ("bounded", True)):
        got[name] = solve_with_ttft_cuts(
            problem,
            lambda p: solve(p, "fast"),
            check(name, honour),
            slo,
            np.ones(k, dtype=np.bool_),
            none,
            standalone,
            max_rounds=3,
        )
    a, b = got["full"], got["bounded"]
    np.testing.assert_array_equal(a.solution.assignment, b.solution.assignment)
    np.testing.assert_array_equal(a.slo_infeasible, b.slo_infeasible)
    np.testing.assert_array_equal(a.still_violating, b.still_violating)
    np.testing.assert_array_equal(a.ttft_ms, b.ttft_ms)
    np.testing.assert_array_equal(a.problem.mask, b.problem.mask)
    np.testing.assert_array_equal(a.problem.cap, b.problem.cap)
    assert a.rounds == b.rounds
    # no check (column, rows, bounds) is simulated twice
    for name in calls:
        assert len(set(calls[name])) == len(calls[name])
