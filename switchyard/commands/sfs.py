"""``switchyard profiles`` and ``switchyard validate-ttft``: step-time profiles and SFS checks.

Thin shell over ``offline.profiles`` (building, fitting, validation) and ``loaders.profiles``.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from offline.profiles import (
    build_profiles,
    dense_from_shared,
    dense_from_vendored,
    read_requests,
    sched_for,
    validate_ttft,
)
from offline.vllm_profile import refit_measured


def register(app: typer.Typer) -> None:
    profiles_app = typer.Typer(help="Step-time profiles (Eq. 9) per <model>@<gpu>.")
    app.add_typer(profiles_app, name="profiles")

    @profiles_app.callback(invoke_without_command=True)
    def profiles_main(
        ctx: typer.Context,
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table"),
    ) -> None:
        """List the step-time profiles with their coefficients and fit errors."""
        if ctx.invoked_subcommand is not None:
            return
        from loaders.profiles import all_profiles

        profs = all_profiles()
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        k: {
                            "coefficients": v["coefficients"],
                            "fit": v["fit"],
                            "tensor_parallel": v["tensor_parallel"],
                        }
                        for k, v in profs.items()
                    },
                    indent=2,
                )
            )
            return
        typer.echo(
            f"{'profile':34s} {'TP':>2s} {'c0 ms':>8s} {'c1 ms/tok':>10s} {'c2 ms/ctx':>10s} "
            f"{'c3 ms/unit':>10s} {'fit MAPE':>8s} {'real MAPE':>9s}"
        )
        for name in sorted(profs):
            r = profs[name]
            c = r["coefficients"]
            real = r["fit"].get("real", {}).get("table_mape")
            typer.echo(
                f"{name:34s} {r['tensor_parallel']:>2d} {c['c0_ms']:8.3f} {c['c1_ms_per_token']:10.2e} "
                f"{c['c2_ms_per_ctx_token']:10.2e} {c['c3_ms_per_attn_unit']:10.2e} "
                f"{100 * r['fit']['mape']:7.2f}% {'' if real is None else f'{100 * real:8.2f}%'}"
            )

    @profiles_app.command("build")
    def profiles_build(
        from_shared: bool = typer.Option(
            False, "--from-shared", help="Re-derive the dense tables from ../shared Vidur files"
        ),
        out: Path = typer.Option(
            None, "--out", help="Write here instead of data/profiles/profiles.json"
        ),
    ) -> None:
        """Re-calibrate the tables and re-fit Eq. 9 (vendored data; --from-shared: raw Vidur files).

        Profiles measured by `switchyard profile-vllm` are re-fitted from their steps files
        (data/profiles/vllm-steps)."""
        from loaders import profiles as prof
        from wiring.paths import shared_data, vendored_data

        data_dir = vendored_data("profiles")
        if from_shared:
            shared = shared_data("profiles")
            if not shared.exists():
                raise typer.BadParameter(
                    f"--from-shared: {shared} not found (set SWITCHYARD_SHARED)"
                )
            tables = dense_from_shared(shared)
        else:
            tables = dense_from_vendored(json.loads(prof.PROFILES_FILE.read_text(encoding="utf-8")))
        result = build_profiles(data_dir, tables)
        existing = json.loads(prof.PROFILES_FILE.read_text(encoding="utf-8"))["profiles"]
        result["profiles"].update(refit_measured(existing, data_dir / "vllm-steps"))
        target = out or prof.PROFILES_FILE
        target.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        prof.clear_cache()
        for name, rec in result["profiles"].items():
            typer.echo(f"{name:34s} fit MAPE {100 * rec['fit']['mape']:.2f}%  -> {target}")

    @app.command("validate-ttft")
    def validate_ttft_cmd(
        requests: Path = typer.Option(
            ..., "--requests", help="Per-request CSV (inference-sim columns)"
        ),
        profile: str = typer.Option(
            ..., "--profile", help="Step-time profile, e.g. llama-2-7b-hf@h100"
        ),
        policy: str = typer.Option("vllm-v1", "--policy", help="vllm-v1 | sarathi | vllm-v0"),
        max_num_batched_tokens: int = typer.Option(None, "--max-num-batched-tokens"),
        max_num_seqs: int = typer.Option(None, "--max-num-seqs"),
        shared_prefix_tokens: int = typer.Option(0, "--shared-prefix-tokens"),
        oracle: bool = typer.Option(False, "--oracle", help="SFS sees real output lengths"),
        noise: float = typer.Option(0.0, "--noise", help="Engine step-time log-normal sigma"),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    ) -> None:
        """Replay a real vLLM request log through the simulated engine and SFS; print TTFT MAPEs."""
        if policy not in ("vllm-v1", "sarathi", "vllm-v0"):
            raise typer.BadParameter(
                f"--policy must be vllm-v1, sarathi or vllm-v0, got {policy!r}"
            )
        if not requests.exists():
            raise typer.BadParameter(f"--requests: {requests} not found")
        try:
            sched = sched_for(
                profile, policy, max_num_batched_tokens, max_num_seqs, shared_prefix_tokens
            )
            req = read_requests(requests)
        except (KeyError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        res = validate_ttft(req, profile, sched, oracle=oracle, noise_sigma=noise)
        if as_json:
            typer.echo(json.dumps(res))
        else:
            for k, v in res.items():
                typer.echo(f"{k:28s} {v}")
