"""``switchyard batch``: budgeted batch inference through the running service, resumable.

    switchyard batch --input prompts.jsonl --budget-usd 2.50 --cluster configs/demo-cluster.yaml \\
        --out results.jsonl

Each input line is a query body (``prompt`` or ``messages``, optional ``id``, ``max_tokens``,
``ttft_slo_ms`` …). Queries go to ``queries`` like any other traffic; each ``Result`` is
appended to ``--out`` as one JSON line as soon as it arrives.

Money: before a query is sent, an upper bound of its cost (highest input price in the
cluster × prompt *bytes* + highest output price × ``max_tokens``; a token is never
shorter than a byte) is reserved in the Redis budget ledger under the job's own period
(``batch-<job>``), atomically and idempotently per query id; when its result arrives
the reservation is settled at the actual cost, which frees the difference. So the job's
spend can never exceed ``--budget-usd``, whatever the prices and lengths turn out to be.

Resuming: ids are stable (the line's ``id``, else a hash of the job name, line number and
text), ids already in ``--out`` are skipped, and results published before an interruption
are read back from the ``results`` topic (from the job's first start, kept in
``<out>.job.json``). A query re-sent after an interruption is not paid twice: its ledger
reservation is idempotent, the router drops an id it already routed, and a worker skips
an id whose result was already published.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from schemas import BadMessage, ClusterConfig, Query, Result
from schemas.parse import validate_model


@dataclass
class BatchJob:
    job: str
    queries: list[Query]
    bounds_usd: dict[str, float]
    bad_lines: list[str] = field(default_factory=list)


def job_name(input_path: Path) -> str:
    """Default job name: the input file's stem, made safe for a ledger period id."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", input_path.stem)[:40] or "job"


def stable_id(job: str, line_no: int, line: str) -> str:
    digest = hashlib.sha256(f"{job}\n{line_no}\n{line}".encode()).hexdigest()[:20]
    return f"batch-{job[:40]}-{digest}"


def cost_bound_usd(q: Query, cluster: ClusterConfig) -> float:
    """An upper bound of what ``q`` can cost on any model of ``cluster``."""
    return max(m.max_cost_usd(q) for m in cluster.models)


def read_jobs(
    input_path: Path, job: str, cluster: ClusterConfig, default_max_tokens: int, tenant: str | None
) -> BatchJob:
    """Parse the input; a bad line is reported (with its number and the reason) and skipped."""
    queries: list[Query] = []
    bad: list[str] = []
    seen: set[str] = set()
    with open(input_path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                body = json.loads(text)
                if not isinstance(body, dict):
                    raise BadMessage(f"must be a JSON object, got {type(body).__name__}")
                body.setdefault("id", stable_id(job, line_no, text))
                if tenant is not None:
                    body["tenant"] = tenant
                if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
                    body["max_tokens"] = default_max_tokens
                q = validate_model(Query, body, what="query")
            except json.JSONDecodeError as exc:
                bad.append(
                    f"{input_path}:{line_no}: malformed JSON: {exc.msg} at column {exc.colno}"
                )
                continue
            except BadMessage as exc:
                bad.append(f"{input_path}:{line_no}: {exc.reason}")
                continue
            if q.id in seen:
                bad.append(f"{input_path}:{line_no}: id {q.id!r} repeats an earlier line")
                continue
            seen.add(q.id)
            queries.append(q)
    bounds = {q.id: cost_bound_usd(q, cluster) for q in queries}
    return BatchJob(job, queries, bounds, bad)


def done_ids(out: Path) -> set[str]:
    """Ids whose result is already in ``out`` (a torn last line is ignored)."""
    ids: set[str] = set()
    if not out.exists():
        return ids
    with open(out, encoding="utf-8") as fh:
        for line in fh:
            try:
                ids.add(str(json.loads(line)["query_id"]))
            except (ValueError, KeyError, TypeError):
                continue
    return ids


@dataclass
class BatchSummary:
    total: int
    skipped_done: int
    completed: int
    errors: int
    over_budget: int
    spend_usd: float
    budget_usd: float
    reserved_usd: float
    bad_lines: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def run_batch(
    job: BatchJob,
    out: Path,
    budget_usd: float,
    concurrency: int,
    result_timeout_s: float,
    progress: bool = True,
) -> BatchSummary:
    from aiokafka import AIOKafkaProducer
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from state import StateStore
    from switchyard.commands.replay import ResultCollector
    from wiring import topics
    from wiring.settings import Settings

    t_start = time.monotonic()
    settings = Settings.from_env()
    meta_path = out.with_name(out.name + ".job.json")
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if meta.get("job") not in (None, job.job):
        raise ValueError(
            f"{out} belongs to job {meta['job']!r}, not {job.job!r}; use another --out or --job"
        )
    started_at = float(meta.get("started_at", time.time()))
    meta_path.write_text(
        json.dumps({"job": job.job, "started_at": started_at, "budget_usd": budget_usd})
    )
    period = f"batch-{job.job}"[:64]

    already = done_ids(out)
    todo = [q for q in job.queries if q.id not in already]
    store = await StateStore.connect(**settings.redis_kwargs())
    collector = ResultCollector(settings, f"batch-{job.job}", from_timestamp_s=started_at - 5.0)
    await collector.start()
    producer = AIOKafkaProducer(**settings.kafka_kwargs(client_id=f"batch-{job.job}"), acks="all",
                                enable_idempotence=True, linger_ms=5)  # fmt: skip
    await producer.start()
    completed = errors = over_budget = 0
    spend = 0.0
    try:
        with open(out, "a", encoding="utf-8") as sink:
            cols = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*cols, disable=not progress) as bar:
                task = bar.add_task(
                    "batch", total=len(job.queries), completed=len(job.queries) - len(todo)
                )
                in_flight: dict[str, Query] = {}
                queue = list(todo)
                refused: list[Query] = []
                last_progress = time.monotonic()
                while queue or in_flight:
                    # send while there is room and money (reserve first, then produce)
                    room = concurrency - len(in_flight)
                    if queue and room > 0:
                        chunk, queue = queue[:room], queue[room:]
                        by_tenant: dict[str, list[Query]] = {}
                        for q in chunk:
                            by_tenant.setdefault(q.tenant, []).append(q)
                        for tenant, group in by_tenant.items():
                            ok = await store.reserve_budget(
                                tenant,
                                period,
                                budget_usd,
                                {q.id: job.bounds_usd[q.id] for q in group},
                            )
                            for q in group:
                                if ok[q.id]:
                                    in_flight[q.id] = q
                                    body = q.model_dump_json(exclude_none=True).encode()
                                    await producer.send(topics.QUERIES, body, key=q.id.encode())
                                else:
                                    refused.append(q)
                        await producer.flush()
                    # collect what came back
                    for qid in [i for i in in_flight if i in collector.results]:
                        res: Result = collector.results[qid]
                        q = in_flight.pop(qid)
                        sink.write(res.model_dump_json() + "\n")
                        sink.flush()
                        await store.settle(q.tenant, period, qid, float(res.cost_usd))
                        spend += float(res.cost_usd)
                        completed += 1
                        errors += res.error is not None
                        bar.advance(task)
                        last_progress = time.monotonic()
                    # money freed by settled results may let refused queries in again
                    if refused and not queue and in_flight:
                        queue, refused = refused, []
                    if not in_flight and not queue:
                        break
                    if time.monotonic() - last_progress > result_timeout_s:
                        raise TimeoutError(
                            f"no result for {len(in_flight)} queries in {result_timeout_s:.0f} s "
                            f"(e.g. {next(iter(in_flight))}); is the router running? Re-run to resume."
                        )
                    await asyncio.sleep(0.05)
                over_budget = len(refused)
        status = await store.budget_status(
            next(iter({q.tenant for q in job.queries}), "default"), period
        )
    finally:
        await producer.stop()
        await collector.stop()
        await store.close()
    return BatchSummary(
        total=len(job.queries),
        skipped_done=len(already & {q.id for q in job.queries}),
        completed=completed,
        errors=errors,
        over_budget=over_budget,
        spend_usd=spend,
        budget_usd=budget_usd,
        reserved_usd=status.reserved_usd,
        bad_lines=len(job.bad_lines),
        seconds=time.monotonic() - t_start,
    )


def register(app: typer.Typer) -> None:
    @app.command("batch")
    def batch_cmd(
        input_path: Path = typer.Option(..., "--input", help="JSON Lines: one query body per line"),
        budget_usd: float = typer.Option(
            ..., "--budget-usd", min=0.0, help="The job's total budget"
        ),
        out: Path = typer.Option(
            ..., "--out", help="Results, one JSON line each (appended; resumable)"
        ),
        cluster: Path = typer.Option(
            Path("configs/demo-cluster.yaml"), "--cluster", help="Cluster config (for the prices)"
        ),
        job: str | None = typer.Option(
            None, "--job", help="Job name (default: the input file's stem)"
        ),
        tenant: str | None = typer.Option(
            None, "--tenant", help="Tenant of every query (default: as given)"
        ),
        max_tokens: int = typer.Option(
            256, "--max-tokens", min=1, help="For lines without max_tokens"
        ),
        concurrency: int = typer.Option(
            256, "--concurrency", min=1, help="Queries in flight at most"
        ),
        result_timeout_s: float = typer.Option(
            300.0, "--result-timeout-s", help="Give up after no progress"
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON"),
    ) -> None:
        """Run a JSONL file of prompts through the service under a budget; resumable."""
        try:
            spec = ClusterConfig.from_file(cluster)
            name = re.sub(r"[^A-Za-z0-9_.\-]", "-", job)[:40] if job else job_name(input_path)
            parsed = read_jobs(input_path, name, spec, max_tokens, tenant)
        except (OSError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        for line in parsed.bad_lines[:20]:
            typer.echo(f"skipped {line}", err=True)
        try:
            summary = asyncio.run(run_batch(parsed, out, budget_usd, concurrency, result_timeout_s))
        except (TimeoutError, ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo(
                f"interrupted; results so far are in {out}; run the same command again to resume",
                err=True,
            )
            raise typer.Exit(130) from None
        if as_json:
            typer.echo(json.dumps(summary.as_dict()))
        else:
            typer.echo(
                f"{summary.completed} done ({summary.errors} with errors), {summary.skipped_done} already in {out}, "
                f"{summary.over_budget} over budget, {summary.bad_lines} bad lines; "
                f"spent {summary.spend_usd:.6f} of {summary.budget_usd:.6f} USD in {summary.seconds:.1f} s"
            )
