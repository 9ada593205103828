"""``switchyard batch``: a JSON Lines file of requests through the service under a budget.

    switchyard batch --input requests.jsonl --budget-usd 2.50 --out results.jsonl

Input lines are OpenAI Batch API requests or Switchyard query bodies; the output, error
and status files are OpenAI's (``batch/``, where the engine lives). Run the same command
again to resume; ``--cancel`` asks a running job to stop (results so far are kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from wiring.paths import DEFAULT_CLUSTER

if TYPE_CHECKING:
    from batch.files import InputRules, JobFiles
    from batch.job import JobConfig
    from schemas.openai_api import BatchObject
    from wiring.settings import Settings


def register(app: typer.Typer) -> None:
    @app.command("batch")
    def batch_cmd(
        input_path: Path = typer.Option(
            ..., "--input", help="JSON Lines: OpenAI Batch API lines or query bodies"
        ),
        out: Path = typer.Option(
            ...,
            "--out",
            help="Output file (responses); errors go to <out>.errors.jsonl, "
            "the batch status to <out>.batch.json",
        ),
        budget_usd: float | None = typer.Option(
            None, "--budget-usd", min=0.0, help="The job's total budget, across resumed runs"
        ),
        cluster: Path = typer.Option(
            DEFAULT_CLUSTER,
            "--cluster",
            envvar="SWITCHYARD_CLUSTER",
            help="Cluster config (prices, models)",
        ),
        job: str | None = typer.Option(
            None, "--job", help="Job name (default: the input file's stem)"
        ),
        tenant: str | None = typer.Option(
            None, "--tenant", help="Tenant of every line (default: as given, else 'default')"
        ),
        max_tokens: int = typer.Option(
            256, "--max-tokens", min=1, help="Output cap of lines that set none"
        ),
        any_model: bool = typer.Option(
            False,
            "--any-model",
            help="Ignore each line's model and let the router choose (OpenAI files name "
            "OpenAI models)",
        ),
        concurrency: int = typer.Option(
            256, "--concurrency", min=1, help="Lines in flight at most"
        ),
        result_timeout_s: float = typer.Option(
            300.0, "--result-timeout-s", help="Fail the run after this long without a result"
        ),
        cancel_grace_s: float = typer.Option(
            30.0, "--cancel-grace-s", help="On cancel, wait this long for results in flight"
        ),
        cancel: bool = typer.Option(
            False, "--cancel", help="Ask the job running with this --out to cancel, then exit"
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the batch object as JSON"),
    ) -> None:
        """Run a JSONL file of requests through the service under a budget; resumable.

        Exit code: 0 every line answered; 1 some lines failed (see the error file);
        2 bad arguments; 3 cancelled; 4 the job failed (no valid line, or no results).
        """
        from batch.files import InputRules, JobFiles, safe_job_name
        from batch.job import ExitCode, JobConfig, exit_code
        from schemas import ClusterConfig
        from wiring.settings import Settings, SettingsError

        files = JobFiles.for_output(input_path, out)
        if cancel:
            files.cancel.write_text("cancel\n")
            typer.echo(f"asked the job writing {out} to cancel ({files.cancel})", err=True)
            return
        if budget_usd is None:
            typer.echo("error: --budget-usd is required", err=True)
            raise typer.Exit(ExitCode.USAGE)
        try:
            spec = ClusterConfig.from_file(cluster)
            settings = Settings.from_env()
            if not input_path.is_file():
                raise ValueError(f"--input {input_path}: no such file")
        except (OSError, ValueError, SettingsError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(ExitCode.USAGE) from None
        files.cancel.unlink(missing_ok=True)
        rules = InputRules(
            job=safe_job_name(job or input_path.stem),
            cluster=spec,
            tenant=tenant,
            default_max_tokens=max_tokens,
            any_model=any_model,
        )
        config = JobConfig(budget_usd, concurrency, result_timeout_s, cancel_grace_s)
        try:
            status = asyncio.run(_run(files, rules, config, settings))
        except (ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(ExitCode.USAGE) from None
        if as_json:
            typer.echo(status.model_dump_json(indent=2))
        else:
            c, sy = status.request_counts, status.switchyard
            typer.echo(
                f"batch {status.id} {status.status}: {c.completed} of {c.total} lines answered, "
                f"{c.failed} failed ({files.errors}); spent {sy['spend_usd']:.6f} of "
                f"{sy['budget_usd']:.6f} USD over {sy['runs']} run(s); output {out}",
                err=True,
            )
            for e in (status.errors or {}).get("data", []):
                typer.echo(f"  {e['code']}: {e['message']}", err=True)
        raise typer.Exit(exit_code(status))


async def _run(
    files: JobFiles, rules: InputRules, config: JobConfig, settings: Settings
) -> BatchObject:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from batch.job import run_job

    cancel = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, cancel.set)
    cols = (TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, transient=True) as bar:
        task = bar.add_task("batch", total=None)
        return await run_job(
            files,
            rules,
            config,
            settings,
            cancel,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
