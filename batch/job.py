"""The batch job engine: input lines → ``queries`` → results → output and error files.

Lifecycle (OpenAI's batch statuses, written to the status file at each step):
``validating`` (every input line parsed; bad lines go to the error file at once) →
``in_progress`` (lines sent while there is room and money; results written as they come)
→ ``finalizing`` → ``completed``; ``cancelling`` → ``cancelled`` when cancelled (a signal
or ``switchyard batch cancel``): nothing more is sent, the results of what was sent are
awaited (``cancel_grace_s``) and kept; ``failed`` when no line is valid or results stop
coming (``result_timeout_s``).

Money: before a line is sent, an upper bound of its cost (``files.cost_bound_usd``) is
reserved in the Redis ledger of the job (tenant ``batch.<job>``, period ``job``: one
budget for the whole job, whatever the lines' tenants), atomically and idempotently per
query id; its result settles it at the real cost. The job's spend is that ledger's: it
counts every run of the job, so a resumed run cannot spend past ``budget_usd`` either.
A line whose bound does not fit once nothing else is in flight is recorded as
``over_budget``.

Resuming: a line with an output line is done; a bad line stays in the error file; every
other line is sent again — with its earlier query id when it has no recorded outcome (the
ledger, the router's dedupe and the workers then neither pay nor run it twice, and its
result is read back from ``results``), with a new attempt id when it failed before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from batch.files import (
    FINAL_ERROR_CODES,
    BadLine,
    InputRules,
    JobFiles,
    Line,
    bad_line_record,
    cost_bound_usd,
    read_input,
    read_lines,
    read_status,
    rewrite,
    write_status,
)
from schemas import Query, Result
from schemas.openai_api import (
    BatchLineError,
    BatchObject,
    BatchOutputLine,
    BatchRequestCounts,
    BatchResponse,
    BatchStatus,
    response_body,
)

if TYPE_CHECKING:  # the Redis client loads only where a job connects its store
    from state.protocols import Ledger

LEDGER_PERIOD = "job"


class ExitCode(IntEnum):
    """What ``switchyard batch`` returns."""

    OK = 0  # every line has a response
    LINES_FAILED = 1  # some lines failed (error file), the rest completed
    USAGE = 2  # bad arguments or configuration
    CANCELLED = 3
    FAILED = 4  # the job itself failed (no valid line, or no results within the timeout)


@dataclass(frozen=True)
class JobConfig:
    budget_usd: float
    concurrency: int = 256
    result_timeout_s: float = 300.0
    cancel_grace_s: float = 30.0
    status_every_s: float = 1.0


@dataclass
class Plan:
    """What validating found: lines to send and what earlier runs already settled."""

    lines: list[Line]
    bad: list[BadLine]
    done: dict[str, BatchOutputLine]  # custom_id -> output line of an earlier run
    attempts: dict[str, int]  # custom_id -> attempt to send now (1 unless it failed before)
    previous: BatchObject | None
    failed_before: list[BatchOutputLine] = field(default_factory=list)  # retried this run

    def todo(self) -> list[Line]:
        return [ln for ln in self.lines if ln.custom_id not in self.done]


def ledger_tenant(job: str) -> str:
    return f"batch.{job}"[:64]


def attempt_id(base: str, attempt: int) -> str:
    return base if attempt <= 1 else f"{base}.{attempt}"


def plan_job(files: JobFiles, rules: InputRules) -> Plan:
    """Validating: parse the input and read what earlier runs of the job left."""
    previous = read_status(files.status)
    if previous is not None and previous.id != f"batch_{rules.job}":
        raise ValueError(
            f"{files.status} belongs to job {previous.id!r}, not batch_{rules.job}; "
            "use another --out or --job"
        )
    lines, bad = read_input(files.input, rules)
    done = {ln.custom_id: ln for ln in read_lines(files.output) if ln.custom_id is not None}
    attempts = dict((previous.switchyard.get("attempts") if previous else None) or {})
    failed: list[BatchOutputLine] = []
    for err in read_lines(files.errors):
        code = err.error.code if err.error else ""
        if err.custom_id is not None and code not in FINAL_ERROR_CODES:
            tried = int((err.switchyard or {}).get("attempt", 1))
            attempts[err.custom_id] = max(attempts.get(err.custom_id, 1), tried + 1)
            failed.append(err)
    return Plan(lines, bad, done, attempts, previous, failed)


@dataclass
class _Flight:
    line: Line
    query: Query
    attempt: int


@dataclass
class JobRun:
    """One run of a job; ``run`` drives it to a final status."""

    files: JobFiles
    rules: InputRules
    config: JobConfig
    plan: Plan
    store: Ledger
    client: Any  # wiring.client.SwitchyardClient, started from the job's creation time
    progress: Any = None  # callable(done, total) or None
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: BatchStatus = "validating"
    stamps: dict[str, int] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    spend_usd: float = 0.0
    in_flight: dict[str, _Flight] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    _settle_later: list[tuple[str, float]] = field(default_factory=list)  # (query id, cost)
    _last_status: float = 0.0

    @property
    def job(self) -> str:
        return self.rules.job

    @property
    def total(self) -> int:
        return len(self.plan.lines) + len(self.plan.bad)

    # ------------------------------------------------------------------ status file

    def batch_object(self) -> BatchObject:
        stamp = {f"{k}_at": v for k, v in self.stamps.items()}
        first = self.plan.lines[0].endpoint if self.plan.lines else "/v1/chat/completions"
        return BatchObject(
            id=f"batch_{self.job}",
            endpoint=first,
            input_file_id=str(self.files.input),
            status=self.status,
            output_file_id=str(self.files.output),
            error_file_id=str(self.files.errors),
            created_at=self.created_at,
            request_counts=BatchRequestCounts(
                total=self.total, completed=self.completed, failed=self.failed
            ),
            errors={"object": "list", "data": self.errors} if self.errors else None,
            switchyard={
                "job": self.job,
                "budget_usd": self.config.budget_usd,
                "spend_usd": round(self.spend_usd, 12),
                "ledger": {"tenant": ledger_tenant(self.job), "period": LEDGER_PERIOD},
                "runs": int(
                    self.plan.previous.switchyard.get("runs", 0) if self.plan.previous else 0
                )
                + 1,
                "attempts": {k: v for k, v in self.plan.attempts.items() if v > 1},
                "in_flight": len(self.in_flight),
            },
        ).model_copy(update=stamp)

    def set_status(self, status: BatchStatus) -> None:
        self.status = status
        self.stamps.setdefault(status, int(time.time()))
        self.write_status(force=True)

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_status >= self.config.status_every_s:
            write_status(self.files.status, self.batch_object())
            self._last_status = now

    # ------------------------------------------------------------------ the run

    async def run(self, cancel: asyncio.Event) -> BatchObject:
        if self.plan.previous is not None:
            self.created_at = self.plan.previous.created_at
        self.set_status("validating")
        self.completed = len([ln for ln in self.plan.lines if ln.custom_id in self.plan.done])
        rewrite(self.files.errors, [bad_line_record(b, self.job) for b in self.plan.bad])
        self.failed = len(self.plan.bad)
        self.files.output.touch()
        await self._restore_ledger()
        if not self.plan.lines:
            self.errors.append({"code": "no_valid_lines", "message": "no valid line in the input"})
            self.set_status("failed")
            return self.batch_object()
        self.set_status("in_progress")
        outcome = await self._send_and_collect(cancel)
        if outcome == "timeout":
            self.set_status("failed")
        elif outcome == "cancelled":
            self.set_status("cancelled")
        else:
            self.set_status("finalizing")
            self.set_status("completed")
        return self.batch_object()

    async def _restore_ledger(self) -> None:
        """Job-wide spend from the ledger; a ledger lost with Redis gets the recorded spend back.

        Lines an earlier run recorded but was killed before settling are settled first (a
        settle is idempotent per query id), so no reservation of a finished line stays booked.
        """
        tenant = ledger_tenant(self.job)
        for done in [*self.plan.done.values(), *self.plan.failed_before]:
            sy = done.switchyard or {}
            if sy.get("query_id"):
                await self.store.settle(
                    tenant, LEDGER_PERIOD, str(sy["query_id"]), float(sy.get("cost_usd") or 0.0)
                )
        status = await self.store.budget_status(tenant, LEDGER_PERIOD)
        recorded = (
            float(self.plan.previous.switchyard.get("spend_usd", 0.0))
            if self.plan.previous
            else 0.0
        )
        if status.committed_usd + 1e-12 < recorded:
            carry = f"carry-{int(time.time())}"
            await self.store.reserve_budget(
                tenant,
                LEDGER_PERIOD,
                max(recorded, self.config.budget_usd),
                {carry: recorded - status.committed_usd},
            )
            await self.store.settle(tenant, LEDGER_PERIOD, carry, recorded - status.committed_usd)
        self.spend_usd = max(status.spent_usd, recorded)

    async def _send_and_collect(self, cancel: asyncio.Event) -> str:
        queue = self.plan.todo()
        refused: list[Line] = []
        # a refusal is final only when nothing else held a reservation at the time: while
        # other lines are in flight their worst cases hold money that their results free
        contested = False
        last_progress = time.monotonic()
        with (
            open(self.files.output, "a", encoding="utf-8") as out,
            open(self.files.errors, "a", encoding="utf-8") as err,
        ):
            while True:
                if (cancel.is_set() or self.files.cancel.exists()) and self.status != "cancelling":
                    self.set_status("cancelling")
                    queue, refused, last_progress = [], [], time.monotonic()
                if (
                    self.status != "cancelling"
                    and queue
                    and len(self.in_flight) < self.config.concurrency
                ):
                    room = self.config.concurrency - len(self.in_flight)
                    chunk, queue = queue[:room], queue[room:]
                    now_refused = await self._send(chunk)
                    refused += now_refused
                    contested = contested or bool(now_refused and self.in_flight)
                if self._collect(out, err):
                    last_progress = time.monotonic()
                    await self._settle_done()
                if refused and not queue and (self.in_flight or contested):
                    # settled results may have freed money: try again, and once more when
                    # the last result is in, so a refusal stands only against settled spend
                    queue, refused, contested = refused, [], bool(self.in_flight)
                if not self.in_flight and not queue:
                    break
                limit = (
                    self.config.cancel_grace_s
                    if self.status == "cancelling"
                    else self.config.result_timeout_s
                )
                if time.monotonic() - last_progress > limit:
                    return self._gave_up(limit)
                self.write_status()
                await asyncio.sleep(0.05)
            for line in refused:
                self._record_error(
                    err, line, self._query(line), "over_budget", self._over_budget(line)
                )
        return "cancelled" if self.status == "cancelling" else "done"

    def _gave_up(self, limit_s: float) -> str:
        example = next(iter(self.in_flight), "?")
        if self.status == "cancelling":
            self.errors.append(
                {
                    "code": "cancel_grace",
                    "message": f"{len(self.in_flight)} results did not arrive within {limit_s:.0f} s of the cancel; a resumed run reads them back",
                }
            )
            return "cancelled"
        self.errors.append(
            {
                "code": "timeout",
                "message": f"no result for {len(self.in_flight)} lines in {limit_s:.0f} s (e.g. {example}); "
                "is the router running? Run the same command again to resume.",
            }
        )
        return "timeout"

    def _query(self, line: Line) -> Query:
        attempt = self.plan.attempts.get(line.custom_id, 1)
        if attempt <= 1:
            return line.query
        return line.query.model_copy(update={"id": attempt_id(line.query.id, attempt)})

    def _over_budget(self, line: Line) -> str:
        bound = cost_bound_usd(line.query, self.rules.cluster)
        return (
            f"its worst-case cost {bound:.6g} USD does not fit in what is left of the job's "
            f"budget of {self.config.budget_usd:g} USD (spent {self.spend_usd:.6g} USD so far)"
        )

    async def _send(self, chunk: Sequence[Line]) -> list[Line]:
        """Reserve each line's bound in the job ledger, then produce the ones that fit."""
        queries = {ln.custom_id: self._query(ln) for ln in chunk}
        amounts = {
            q.id: cost_bound_usd(ln.query, self.rules.cluster)
            for ln, q in zip(chunk, queries.values(), strict=True)
        }
        ok = await self.store.reserve_budget(
            ledger_tenant(self.job), LEDGER_PERIOD, self.config.budget_usd, amounts
        )
        sent, refused = [], []
        for ln in chunk:
            q = queries[ln.custom_id]
            if ok[q.id]:
                sent.append(q)
                self.in_flight[q.id] = _Flight(ln, q, self.plan.attempts.get(ln.custom_id, 1))
            else:
                refused.append(ln)
        if sent:
            await self.client.submit_many(sent)
        return refused

    def _collect(self, out: Any, err: Any) -> bool:
        arrived = [qid for qid in self.in_flight if self.client.get(qid) is not None]
        for qid in arrived:
            flight = self.in_flight[qid]
            res: Result = self.client.get(qid)
            self._settle_later.append((qid, float(res.cost_usd)))
            if res.error is None:
                self._record_response(out, flight, res)
            else:
                # the router's own kind when it set one (e.g. insufficient_quota: the tenant's
                # budget, not the job's, is spent), else who failed it
                who = "not_routed" if not res.instance_id else "engine_error"
                code = res.code.value if res.code else who
                self._record_error(
                    err, flight.line, flight.query, code, res.error, res, flight.attempt
                )
            del self.in_flight[qid]
        if arrived:
            out.flush()
            err.flush()
        return bool(arrived)

    async def _settle_done(self) -> None:
        tenant = ledger_tenant(self.job)
        todo, self._settle_later = self._settle_later, []
        for qid, cost in todo:
            await self.store.settle(tenant, LEDGER_PERIOD, qid, cost)
        status = await self.store.budget_status(tenant, LEDGER_PERIOD)
        self.spend_usd = status.spent_usd

    def _record_response(self, out: Any, flight: _Flight, res: Result) -> None:
        line = BatchOutputLine(
            id=f"batch_req_{res.query_id}",
            custom_id=flight.line.custom_id,
            response=BatchResponse(
                status_code=200,
                request_id=res.query_id,
                body=response_body(flight.query, res, int(res.finished_at)),
            ),
            switchyard={
                "line": flight.line.line_no,
                "query_id": res.query_id,
                "attempt": flight.attempt,
                "cost_usd": res.cost_usd,
            },
        )
        out.write(line.model_dump_json() + "\n")
        self.completed += 1
        if self.progress is not None:
            self.progress(self.completed + self.failed, self.total)

    def _record_error(
        self,
        err: Any,
        line: Line,
        query: Query,
        code: str,
        message: str,
        res: Result | None = None,
        attempt: int = 1,
    ) -> None:
        record = BatchOutputLine(
            id=f"batch_req_{query.id}",
            custom_id=line.custom_id,
            error=BatchLineError(code=code, message=message, line=line.line_no),
            switchyard={
                "line": line.line_no,
                "query_id": query.id,
                "attempt": attempt,
                "cost_usd": res.cost_usd if res is not None else 0.0,
                "instance_id": res.instance_id if res is not None else None,
            },
        )
        err.write(record.model_dump_json() + "\n")
        self.failed += 1
        if self.progress is not None:
            self.progress(self.completed + self.failed, self.total)


def exit_code(status: BatchObject) -> ExitCode:
    if status.status == "cancelled":
        return ExitCode.CANCELLED
    if status.status == "failed":
        return ExitCode.FAILED
    counts = status.request_counts
    if counts.failed or counts.completed < counts.total:
        return ExitCode.LINES_FAILED
    return ExitCode.OK


async def run_job(
    files: JobFiles,
    rules: InputRules,
    config: JobConfig,
    settings: Any,
    cancel: asyncio.Event | None = None,
    progress: Any = None,
) -> BatchObject:
    """Plan, connect to Redis and Kafka, run to a final status; the status file is written."""
    from state import StateStore
    from wiring.client import SwitchyardClient

    plan = plan_job(files, rules)
    created = plan.previous.created_at if plan.previous is not None else int(time.time())
    store = await StateStore.connect(**settings.redis_kwargs())
    client = SwitchyardClient(
        settings=settings, client_id=f"batch-{rules.job}", from_timestamp_s=created - 5.0
    )
    try:
        await client.start()
        run = JobRun(files, rules, config, plan, store, client, progress, created_at=created)
        return await run.run(cancel or asyncio.Event())
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        await store.close()
