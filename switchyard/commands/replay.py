"""``switchyard replay``: real traffic through the running service, then the report.

Arrival times (and output lengths) come from a trace (``arrival_s, input_tokens,
output_tokens`` CSV, e.g. ``../shared/data/traces/azure_llm_2023_conv.csv.gz``); query
texts and per-model quality scores from a routing dataset (``offline.datasets``). Each
arrival becomes a ``Query`` (the dataset's text, ``max_tokens`` from the trace) produced
to ``queries`` at the trace's time (``--rate-scale`` 2 = twice as fast); results are
collected from ``results`` with a live progress bar. The report uses the simulator's
definitions (sim/evaluator.py): utility = the dataset's score of the model that served
the query (minus λ·cost), OnTimeUtility counts it only when TTFT ≤ SLO, SLO attainment,
spend vs the tenant budget, TTFT p50/p99 and per-instance load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer


@dataclass
class ReplayRecord:
    """One replayed query: what was asked and what came back (None: no result in time)."""

    query_id: str
    data_row: int
    slo_ms: float
    sent_at: float
    result: Any = None  # schemas.Result


@dataclass
class ReplayReport:
    queries: int
    results: int
    missing: int
    errors: int
    not_routed: int
    ontime_utility: float
    mean_utility: float
    slo_attainment: float
    mean_quality: float
    spend_usd: float
    budget_usd: float | None
    ttft_p50_ms: float
    ttft_p99_ms: float
    per_instance: dict[str, dict[str, float]] = field(default_factory=dict)
    duration_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in self.__dict__.items()
        }


def build_report(
    records: Sequence[ReplayRecord],
    scores: np.ndarray,
    models: Sequence[str],
    lam_per_usd: float = 0.0,
    budget_usd: float | None = None,
    duration_s: float = 0.0,
    score_as: Mapping[str, str] | None = None,
) -> ReplayReport:
    """The simulator's figures over what the service really did. ``score_as``: the data
    column a served model is scored by (the cluster's ``quality_as``), else its own name."""
    col = {m: j for j, m in enumerate(models)}
    col.update({m: col[key] for m, key in (score_as or {}).items() if key in col})
    n = len(records)
    utility = np.zeros(n)
    on_time = np.zeros(n, dtype=bool)
    quality = np.zeros(n)
    ttfts: list[float] = []
    spend = 0.0
    errors = not_routed = missing = 0
    load: dict[str, dict[str, float]] = {}
    for i, rec in enumerate(records):
        res = rec.result
        if res is None:
            missing += 1
            continue
        spend += float(res.cost_usd)
        if not res.instance_id:
            not_routed += 1
            continue
        row = load.setdefault(
            res.instance_id, {"queries": 0.0, "errors": 0.0, "ttft_ms_sum": 0.0, "ok": 0.0}
        )
        row["queries"] += 1
        if res.error is not None:
            errors += 1
            row["errors"] += 1
            continue
        j = col.get(res.model)
        score = float(scores[rec.data_row, j]) if j is not None else float("nan")
        score = 0.0 if math.isnan(score) else score
        quality[i] = score
        utility[i] = score - lam_per_usd * float(res.cost_usd)
        if res.ttft_ms is not None:
            ttfts.append(float(res.ttft_ms))
            row["ttft_ms_sum"] += float(res.ttft_ms)
            row["ok"] += 1
            on_time[i] = float(res.ttft_ms) <= rec.slo_ms
    per_instance = {
        iid: {
            "queries": int(r["queries"]),
            "share": r["queries"] / max(n, 1),
            "errors": int(r["errors"]),
            "ttft_mean_ms": r["ttft_ms_sum"] / r["ok"] if r["ok"] else float("nan"),
        }
        for iid, r in sorted(load.items())
    }
    t = np.asarray(ttfts)
    return ReplayReport(
        queries=n,
        results=n - missing,
        missing=missing,
        errors=errors,
        not_routed=not_routed,
        ontime_utility=float(np.where(on_time, utility, np.minimum(utility, 0.0)).mean())
        if n
        else 0.0,
        mean_utility=float(utility.mean()) if n else 0.0,
        slo_attainment=float(on_time.mean()) if n else 0.0,
        mean_quality=float(quality.mean()) if n else 0.0,
        spend_usd=spend,
        budget_usd=budget_usd,
        ttft_p50_ms=float(np.percentile(t, 50)) if t.size else float("nan"),
        ttft_p99_ms=float(np.percentile(t, 99)) if t.size else float("nan"),
        per_instance=per_instance,
        duration_s=duration_s,
    )


def print_report(report: ReplayReport, title: str = "replay") -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title=f"Switchyard {title}: {report.queries} queries in {report.duration_s:.0f} s"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    rows = [
        ("results / missing", f"{report.results} / {report.missing}"),
        ("engine errors / not routed", f"{report.errors} / {report.not_routed}"),
        ("OnTimeUtility", f(report.ontime_utility, ".4f")),
        ("mean utility", f(report.mean_utility, ".4f")),
        ("SLO attainment", f(report.slo_attainment * 100, ".1f") + " %"),
        ("mean quality", f(report.mean_quality, ".4f")),
        (
            "spend vs budget (USD)",
            f"{report.spend_usd:.6f} / "
            + (f(report.budget_usd, ".6f") if report.budget_usd is not None else "none"),
        ),
        ("TTFT p50 / p99 (ms)", f"{f(report.ttft_p50_ms, '.0f')} / {f(report.ttft_p99_ms, '.0f')}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    load = Table(title="per-instance load")
    for c in ("instance", "queries", "share", "errors", "mean TTFT ms"):
        load.add_column(c, justify="right" if c != "instance" else "left")
    for iid, r in report.per_instance.items():
        load.add_row(
            iid,
            str(r["queries"]),
            f"{r['share'] * 100:.1f} %",
            str(r["errors"]),
            f(r["ttft_mean_ms"], ".0f"),
        )
    console.print(load)


class ResultCollector:
    """Reads ``results`` (every partition, from its end at start, or from a time) and keeps
    the first result per id.

    Its own reader rather than ``switchyard.client``: positioned on all partitions before
    the first query is produced, so no result of this run can be missed.
    """

    def __init__(
        self, settings: Any, client_id: str, from_timestamp_s: float | None = None
    ) -> None:
        self.settings = settings
        self.from_timestamp_s = from_timestamp_s
        self.client_id = client_id
        self.results: dict[str, Any] = {}
        self.duplicates = 0
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer

        from wiring import kafka_admin, topics

        kw = self.settings.kafka_kwargs(client_id=self.client_id)
        await kafka_admin.ensure_topics(
            kw, [topics.QUERIES, topics.RESULTS], **self.settings.topic_kwargs()
        )
        tps = await kafka_admin.partitions(kw, [topics.RESULTS])
        consumer = AIOKafkaConsumer(**kw, enable_auto_commit=False)
        await consumer.start()
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        if self.from_timestamp_s is not None:  # read back results published since then
            found = await consumer.offsets_for_times(
                {tp: int(self.from_timestamp_s * 1000) for tp in tps}
            )
            for tp in tps:
                if found.get(tp) is not None:
                    consumer.seek(tp, found[tp].offset)
        for tp in tps:
            await consumer.position(tp)
        self._consumer = consumer
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        from pydantic import ValidationError

        from schemas import Result

        while True:
            batch = await self._consumer.getmany(timeout_ms=200, max_records=5000)
            for records in batch.values():
                for r in records:
                    try:
                        res = Result.model_validate_json(r.value)
                    except (ValidationError, ValueError):
                        continue
                    if res.query_id in self.results:
                        self.duplicates += 1
                    else:
                        self.results[res.query_id] = res

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()


async def replay(
    trace_path: Path,
    data_path: Path,
    data_format: str,
    models_csv: Path | None,
    rate_scale: float,
    duration_s: float,
    start_s: float,
    slo_ms: float,
    tenant: str,
    result_timeout_s: float,
    max_output_tokens: int,
    seed: int,
    progress: bool = True,
) -> tuple[list[ReplayRecord], Any, float]:
    """Produce the trace's queries at its timing; wait for their results."""
    from aiokafka import AIOKafkaProducer
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from offline.datasets import load_routing_data
    from schemas import Query
    from sim.traffic import load_trace
    from wiring import topics
    from wiring.settings import Settings

    trace = load_trace(trace_path).window(start_s, duration_s)
    if rate_scale != 1.0:
        trace = trace.scaled(rate_scale)
    if trace.n == 0:
        raise ValueError(
            f"{trace_path}: no arrivals between {start_s} s and {start_s + duration_s} s"
        )
    data = load_routing_data(data_path, data_format, models_csv)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, data.n, trace.n)
    run = uuid.uuid4().hex[:8]
    settings = Settings.from_env()
    records: list[ReplayRecord] = []
    collector = ResultCollector(settings, f"replay-{run}")
    await collector.start()
    producer = AIOKafkaProducer(**settings.kafka_kwargs(client_id=f"replay-{run}"), acks="all",
                                enable_idempotence=True, linger_ms=2)  # fmt: skip
    await producer.start()
    try:
        cols = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*cols, disable=not progress, transient=False) as bar:
            sent_bar = bar.add_task("sent", total=trace.n)
            got_bar = bar.add_task("results", total=trace.n)
            acks = []
            t0 = time.monotonic()
            for i in range(trace.n):
                delay = float(trace.arrival_s[i]) - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                row = int(rows[i])
                qid = f"replay-{run}-{i}"
                out_tokens = int(max(1, min(max_output_tokens, int(trace.output_tokens[i]))))
                task = data.tasks[row][:128] if data.tasks[row] else None
                q = Query(id=qid, tenant=tenant, prompt=data.texts[row], max_tokens=out_tokens,
                          ttft_slo_ms=slo_ms, created_at=time.time(), task=task)  # fmt: skip
                records.append(ReplayRecord(qid, row, slo_ms, time.time()))
                body = q.model_dump_json(exclude_none=True).encode()
                acks.append(await producer.send(topics.QUERIES, body, key=qid.encode()))
                bar.update(sent_bar, completed=i + 1)
                bar.update(got_bar, completed=len(collector.results))
            await asyncio.gather(*acks)
            deadline = time.monotonic() + result_timeout_s
            ids = [r.query_id for r in records]
            while time.monotonic() < deadline:
                got = sum(1 for q in ids if q in collector.results)
                bar.update(got_bar, completed=got)
                if got == len(ids):
                    break
                await asyncio.sleep(0.2)
            elapsed = time.monotonic() - t0
    finally:
        await producer.stop()
        await collector.stop()
    for rec in records:
        rec.result = collector.results.get(rec.query_id)
    return records, data, elapsed


def _score_as(cluster: Path | None) -> dict[str, str]:
    """Each cluster model's ``quality_as`` (the data column it is scored by)."""
    if cluster is None:
        return {}
    from schemas import ClusterConfig

    return {m.name: m.quality_as for m in ClusterConfig.from_file(cluster).models if m.quality_as}


def _budget_of(cluster: Path | None, tenant: str) -> float | None:
    if cluster is None:
        return None
    from schemas import ClusterConfig

    spec = ClusterConfig.from_file(cluster)
    for t in spec.tenants:
        if t.tenant == tenant:
            return t.budget_usd
    return None


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay_cmd(
        trace: Path = typer.Option(
            ...,
            "--trace",
            help="Trace CSV(.gz) (arrival_s,input_tokens,output_tokens), or azure-conv | azure-code | mooncake",
        ),
        data: Path = typer.Option(
            ..., "--data", help="Routing dataset (texts and per-model scores)"
        ),
        data_format: str = typer.Option("long", "--format", help="irt-wide, long or nq-records"),
        models_csv: Path | None = typer.Option(
            None, "--models-csv", help="Prices (default: beside --data)"
        ),
        rate_scale: float = typer.Option(1.0, "--rate-scale", min=1e-6, help="2 = twice as fast"),
        duration_s: float = typer.Option(
            120.0, "--duration-s", min=0.001, help="Trace seconds to replay"
        ),
        start_s: float = typer.Option(
            0.0, "--start-s", min=0.0, help="Where in the trace to start"
        ),
        slo_ms: float = typer.Option(2000.0, "--slo-ms", help="TTFT SLO of every query"),
        tenant: str = typer.Option("default", "--tenant"),
        cluster: Path | None = typer.Option(
            None, "--cluster", help="For the tenant budget in the report"
        ),
        lam: float = typer.Option(0.0, "--lambda", help="Utility = score − λ·cost (USD)"),
        max_output_tokens: int = typer.Option(1024, "--max-output-tokens", min=1),
        result_timeout_s: float = typer.Option(
            120.0, "--result-timeout-s", help="Wait for results this long"
        ),
        out: Path | None = typer.Option(None, "--out", help="Write the report (JSON) here"),
        seed: int = typer.Option(0, "--seed"),
    ) -> None:
        """Replay a trace through the running service and print the report."""
        if (
            not trace.exists()
        ):  # a trace name: azure-conv, azure-code, mooncake (../shared/data/traces)
            from sim.traffic import TRACE_FILES
            from wiring.paths import shared_data

            if str(trace) in TRACE_FILES:
                trace = shared_data("traces", TRACE_FILES[str(trace)])
        if models_csv is None and (data.parent / "models.csv").exists():
            models_csv = data.parent / "models.csv"
        try:
            records, rdata, elapsed = asyncio.run(
                replay(trace, data, data_format, models_csv, rate_scale, duration_s, start_s, slo_ms,
                       tenant, result_timeout_s, max_output_tokens, seed)
            )  # fmt: skip
        except (ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        report = build_report(
            records, rdata.scores, rdata.models, lam, _budget_of(cluster, tenant), elapsed,
            score_as=_score_as(cluster),
        )  # fmt: skip
        print_report(report)
        if out is not None:
            out.write_text(json.dumps(report.as_dict(), indent=2))
        if report.missing:
            typer.echo(
                f"warning: {report.missing} queries got no result within the timeout", err=True
            )
