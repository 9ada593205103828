"""``switchyard profile-vllm``: measure a real vLLM engine's step times and fit Eq. 9 to them.

Thin shell over ``switchyard.vllm_profiling`` (runs the engine step by step) and
``offline.vllm_profile`` (the fit and the profile record).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("profile-vllm")
    def profile_vllm(
        model: Path = typer.Option(
            None,
            "--model",
            help="Model directory vLLM loads (default: the shipped random-weight Qwen3 shape)",
        ),
        name: str = typer.Option(
            None, "--name", help="Profile name <model>@<device> (default: qwen3-<shape>@cpu)"
        ),
        out: Path = typer.Option(
            Path("profile-vllm.json"),
            "--out",
            help="Write the profile here (profiles.json format: {version, profiles: {name: ..}})",
        ),
        steps_out: Path = typer.Option(
            None,
            "--steps-out",
            help="Measured steps (JSON lines; .gz to gzip); default beside --out",
        ),
        from_steps: Path = typer.Option(
            None, "--from-steps", help="Re-fit an existing steps file; vLLM is not started"
        ),
        merge_into: Path = typer.Option(
            None,
            "--merge-into",
            help="Also add (or replace) the profile in this profiles file, e.g. "
            "data/profiles/profiles.json, so a cluster config can name it (`profile:`)",
        ),
        max_num_seqs: int = typer.Option(16, "--max-num-seqs"),
        max_num_batched_tokens: int = typer.Option(512, "--max-num-batched-tokens"),
        max_model_len: int = typer.Option(2048, "--max-model-len"),
        kv_cache_gib: int = typer.Option(1, "--kv-cache-gib", help="VLLM_CPU_KVCACHE_SPACE"),
        threads: int = typer.Option(1, "--threads", help="OMP_NUM_THREADS of the engine"),
        shape: str = typer.Option(
            "tiny",
            "--shape",
            help="Named random-weight Qwen3 shape (switchyard.vllm_model.SHAPES) when no --model",
        ),
        executor: str = typer.Option(
            "mp",
            "--executor",
            help="mp: the model in a pinned worker process, as `vllm serve` runs it; "
            "uni: in the engine core's process",
        ),
        reps: int = typer.Option(
            3, "--reps", help="Run the sweep this many times; each batch's median time is fitted"
        ),
        quick: bool = typer.Option(False, "--quick", help="A short sweep (a smoke test)"),
        timeout_s: float = typer.Option(3600.0, "--timeout-s"),
        as_json: bool = typer.Option(False, "--json", help="Print the fit as JSON"),
    ) -> None:
        """Drive vLLM's engine step by step, vary the batch, time each step, fit Eq. 9.

        Writes the measured steps and a profile with its provenance (vLLM version, CPU model,
        threads, date, command) and fit error per step kind (decode, prefill, mixed).
        """
        from offline.vllm_profile import profile_record, read_steps
        from switchyard import vllm_env, vllm_model, vllm_profiling

        steps_path = steps_out or out.with_name(out.stem + ".steps.jsonl")
        summary: dict[str, float] = {}
        if from_steps is not None:
            if not from_steps.is_file():
                raise typer.BadParameter(f"--from-steps: {from_steps} not found")
            steps_path = from_steps
        else:
            try:
                settings = vllm_profiling.ProfileSettings(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len,
                    kv_cache_gib=kv_cache_gib,
                    threads=threads,
                    quick=quick,
                    reps=reps,
                    executor=executor,
                )
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from exc
            if shape not in vllm_model.SHAPES:
                raise typer.BadParameter(f"--shape {shape}: known: {sorted(vllm_model.SHAPES)}")
            model_dir = model or vllm_model.make_model_dir(vllm_model.SHAPES[shape])
            if model is not None and not (model / "config.json").is_file():
                raise typer.BadParameter(f"--model {model}: no config.json there")
            try:
                summary = vllm_profiling.run_driver(
                    model_dir,
                    name or f"qwen3-{shape}@cpu",
                    steps_path,
                    settings,
                    command=vllm_profiling.command_line(
                        [
                            "switchyard",
                            "profile-vllm",
                            *(["--model", str(model)] if model else ["--shape", shape]),
                            "--name",
                            name or f"qwen3-{shape}@cpu",
                            "--max-num-seqs",
                            str(max_num_seqs),
                            "--max-num-batched-tokens",
                            str(max_num_batched_tokens),
                            "--max-model-len",
                            str(max_model_len),
                            "--kv-cache-gib",
                            str(kv_cache_gib),
                            "--threads",
                            str(threads),
                            "--reps",
                            str(reps),
                            "--executor",
                            executor,
                            *(["--quick"] if quick else []),
                        ]
                    ),  # the settings as given (not sys.argv: no local paths, same in tests)
                    timeout_s=timeout_s,
                )
            except (vllm_profiling.ProfileError, vllm_env.VllmInstallError) as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(1) from None
        try:
            header, steps = read_steps(steps_path)
            rec = profile_record(steps, header)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        prof_name = (name or str(header.get("model") or f"qwen3-{shape}@cpu")).lower()
        rec["provenance"]["steps_file"] = steps_path.name
        doc = {"version": 1, "profiles": {prof_name: rec}}
        out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        if merge_into is not None:
            target = json.loads(merge_into.read_text(encoding="utf-8"))
            if not isinstance(target, dict) or "profiles" not in target:
                raise typer.BadParameter(f"--merge-into {merge_into}: not a profiles file")
            target["profiles"][prof_name] = rec
            merge_into.write_text(json.dumps(target, indent=1) + "\n", encoding="utf-8")
        if as_json:
            typer.echo(json.dumps({"name": prof_name, "summary": summary, **rec["fit"]}))
            return
        c = rec["coefficients"]
        typer.echo(
            f"{prof_name}: {rec['fit']['rows']} steps ({rec['fit']['stalls_left_out']} stalls "
            f"left out) -> {out}" + (f" and {merge_into}" if merge_into else "")
        )
        typer.echo(
            f"  Eq. 9: c0 {c['c0_ms']:.4g} ms, c1 {c['c1_ms_per_token']:.4g} ms/token, "
            f"c2 {c['c2_ms_per_ctx_token']:.4g} ms/ctx token, c3 {c['c3_ms_per_attn_unit']:.4g} "
            "ms/attn unit"
        )
        for label, key in (("Eq. 9", "eq9"), ("table", "table")):
            st = rec["fit"][key]
            row = "  ".join(
                f"{k} {100 * v['mape']:.1f}%/{100 * v['p90_ape']:.1f}%/{100 * v['max_ape']:.1f}%"
                f" ({v['steps']})"
                for k, v in st["by_kind"].items()
            )
            typer.echo(
                f"  {label} fit MAPE/p90/max: all {100 * st['mape']:.1f}%/"
                f"{100 * st['p90_ape']:.1f}%/{100 * st['max_ape']:.1f}%  {row}"
            )
        if summary:
            typer.echo(f"  measured in {summary.get('wall_s')} s (steps file {steps_path})")
