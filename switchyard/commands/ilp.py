"""``switchyard allocate``: offline instance allocation under a GPU budget (paper B).

Thin shell over ``offline.datasets`` and ``routing.allocation`` (all logic is there).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _per_model(option: str, text: str, models: list[str] | None) -> dict[str, int] | int:
    """``"4"`` (every model) or ``"a=1,b=8,default=2"``."""
    text = text.strip()
    if "=" not in text:
        try:
            value = int(text)
        except ValueError:
            raise typer.BadParameter(
                f"{option} must be an integer or name=int pairs, got {text!r}"
            ) from None
        if value < 0:
            raise typer.BadParameter(f"{option} must be >= 0, got {value}")
        return value
    out: dict[str, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, _, val = part.partition("=")
        try:
            out[name.strip()] = int(val)
        except ValueError:
            raise typer.BadParameter(f"{option}: {part!r} is not name=int") from None
        if out[name.strip()] < 0:
            raise typer.BadParameter(f"{option}: {part!r} must be >= 0")
    if models is not None:
        unknown = sorted(set(out) - set(models) - {"default"})
        if unknown:
            raise typer.BadParameter(
                f"{option} names unknown models {unknown}; the data has {models}"
            )
    return out


def _expand(option: str, spec: dict[str, int] | int, models: list[str], default: int) -> list[int]:
    if isinstance(spec, int):
        return [spec] * len(models)
    fallback = spec.get("default", default)
    return [spec.get(m, fallback) for m in models]


def register(app: typer.Typer) -> None:
    @app.command("allocate")
    def allocate(
        gpus: int = typer.Option(..., "--gpus", min=0, help="GPU budget G"),
        data: Path = typer.Option(..., "--data", help="Historical routing data file"),
        format: str = typer.Option("irt-wide", "--format", help="irt-wide, long or nq-records"),
        models_csv: Path | None = typer.Option(
            None, "--models-csv", help="Per-model prices (default: models.csv beside --data)"
        ),
        gpus_per_instance: str = typer.Option(
            "1",
            "--gpus-per-instance",
            help="GPUs per instance: N, or name=N,...,default=N (0: cloud)",
        ),
        slots_per_instance: str = typer.Option(
            "8",
            "--slots-per-instance",
            help="Queries one instance takes per window: N or name=N,...",
        ),
        window: int = typer.Option(64, "--window", min=1, help="Queries per sampled window"),
        windows: int = typer.Option(16, "--windows", min=1, help="Sampled windows"),
        budget_fraction: float | None = typer.Option(
            None,
            "--budget-fraction",
            help="Window budget as a fraction of sending every query to the best single model",
        ),
        seed: int = typer.Option(0, "--seed"),
        time_limit_s: float = typer.Option(120.0, "--time-limit-s", help="MIP time limit"),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    ) -> None:
        """Choose instance counts per model to maximise expected batch quality."""
        import numpy as np

        from offline.datasets import load_routing_data
        from routing.allocation import (
            AllocationProblem,
            evaluate_allocation,
            solve_allocation,
            uniform_allocation,
        )

        gpu_spec = _per_model("--gpus-per-instance", gpus_per_instance, None)
        slot_spec = _per_model("--slots-per-instance", slots_per_instance, None)
        try:
            rd = load_routing_data(data, format, models_csv)
        except (OSError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        models = list(rd.models)
        for option, spec in (
            ("--gpus-per-instance", gpu_spec),
            ("--slots-per-instance", slot_spec),
        ):
            if isinstance(spec, dict):
                _per_model(option, ",".join(f"{k}={v}" for k, v in spec.items()), models)
        g = np.array(_expand("--gpus-per-instance", gpu_spec, models, 1), dtype=np.int64)
        slots = np.array(_expand("--slots-per-instance", slot_spec, models, 8), dtype=np.int64)
        cost = rd.realised_cost_usd()
        if not np.isfinite(cost).all():
            if budget_fraction is not None:
                typer.echo("error: --budget-fraction needs prices (--models-csv)", err=True)
                raise typer.Exit(2)
            cost = np.zeros_like(rd.scores)
        scores = np.nan_to_num(rd.scores, nan=0.0)
        best = int(scores.mean(axis=0).argmax())
        budget = None
        if budget_fraction is not None:
            budget = float(budget_fraction) * min(window, rd.n) * float(cost[:, best].mean())
        try:
            problem = AllocationProblem(scores, cost, g, slots, gpus, window, windows, budget, seed)
            alloc = solve_allocation(problem, time_limit_s=time_limit_s)
            fixed = uniform_allocation(problem)
            fixed_quality = evaluate_allocation(problem, fixed)
        except (ValueError, RuntimeError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        out = {
            "instances": {m: int(c) for m, c in zip(models, alloc.instances, strict=True)},
            "gpus_used": alloc.gpus_used,
            "gpu_budget": gpus,
            "expected_quality": round(alloc.expected_quality, 6),
            "bound": round(alloc.bound, 6),
            "gap": round(alloc.gap, 6),
            "fixed_allocation": {
                "instances": {m: int(c) for m, c in zip(models, fixed, strict=True)},
                "expected_quality": round(fixed_quality, 6),
            },
            "best_single_model": {
                "model": models[best],
                "mean_score": round(float(scores[:, best].mean()), 6),
            },
            "window_budget_usd": budget,
            "windows": windows,
            "window_size": min(window, rd.n),
            "solver_seconds": round(alloc.solver_seconds, 3),
            "status": alloc.status,
        }
        if as_json:
            typer.echo(json.dumps(out))
            return
        for name, count in zip(models, alloc.instances.tolist(), strict=True):
            typer.echo(f"{name:32s} {count:4d} instances × {int(g[models.index(name)])} GPUs")
        typer.echo(
            f"GPUs {alloc.gpus_used}/{gpus}; expected quality {alloc.expected_quality:.4f} "
            f"(fixed even split {fixed_quality:.4f}; gap {alloc.gap:.2e})"
        )
