"""One batch line on the engine: run it, then commit its result row or put it back for a retry.

The runner (gateway/batch/runner.py) decides which line runs next; this module runs it through
the request pipeline (gateway/pipeline/stages.py) as a BE request of the batch's tenant, and
commits the outcome to SQL as it arrives: `succeeded` with the completion body, `failed` with an
error-file line, or back to `pending` with a time to retry when the failure was retryable (the
engine down, aborting it, a quota).

Attempts are counted in SQL (`batch_items.attempts`) when a line is taken to run, before its
request is sent: a line that crashes the engine — or the gateway — on every try is counted
across restarts of both, and after `batch.max_attempts` it goes to the error file instead of
crashing the engine again after every restart. A try that never reached the engine (it was
unreachable, or refused it for capacity) is given back: an engine that is down only delays
lines, however long it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from aiohttp import web

from backend.policy.batch_order.feed import BatchFeed
from common.config import BatchConfig
from gateway.api.render import ResponseHead, completion_body, usage_body
from gateway.api.schemas import Endpoint
from gateway.auth import Principal
from gateway.batch.lines import now_utc
from gateway.batch.prepare import PreparedLine
from gateway.batch.store import BatchStore
from gateway.batch.types import BatchInfo, ItemResult
from gateway.pipeline.outcome import (
    Failure,
    attempts_exhausted,
    batch_expired,
    client_disconnected,
    internal_error,
    interrupted,
)
from gateway.pipeline.stages import Completion, Flight, complete, prepare, recording
from gateway.state import CONFIG
from gateway.store.outage import DATABASE_OUTAGE
from gateway.store.types import Tenant

log = logging.getLogger(__name__)


@dataclass
class ActiveBatch:
    """An in_progress batch the runner is feeding."""

    info: BatchInfo
    tenant: Tenant
    kind: Endpoint
    feed: BatchFeed
    prepared: dict[int, PreparedLine]
    custom_ids: dict[int, str]
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    """Each running line's task: it writes the line's outcome to SQL, so it is never cancelled
    (a task cancelled inside a SQLite write can leave its connection holding the write lock,
    and every later write fails "database is locked"); to stop a line, cancel its call."""
    calls: dict[int, asyncio.Task[Any]] = field(default_factory=dict)
    """Each running line's engine request (`complete`): cancelling one aborts the request, and
    its line's task then ends without writing an outcome (the line stays `running`, for the
    wind-down or the next start to settle)."""
    retry: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time when it may run again, line) of lines the engine could not take."""
    down_streak: int = 0
    """Consecutive lines that found the engine unreachable (backs the retries off)."""
    stopping: str | None = None
    """"expired" or "cancelled" once the batch is being wound down, "closing" when the gateway
    stops: no line starts its engine request after that."""

    @property
    def priority(self) -> tuple[datetime, datetime]:
        """Earliest deadline first, then earliest expiry."""
        deadline = self.info.deadline_at or self.info.expires_at
        return deadline, self.info.expires_at


async def execute_line(
    app: web.Application, store: BatchStore, active: ActiveBatch, line_no: int
) -> int | None:
    """Runs one line through the request pipeline and commits how it ended; returns its output
    length when it succeeded."""
    batch_id = active.info.id
    cfg = app[CONFIG].batch
    attempt = await store.mark_running(batch_id, line_no)
    if attempt is None:
        return None
    if attempt > cfg.max_attempts:
        # Only a line whose last attempt was in flight when the gateway stopped gets here (any
        # other failure settles at the bound): it is not sent again.
        await store.finish_item(batch_id, line_no, refusal(attempts_exhausted(attempt - 1)))
        return None
    try:
        return await _run_attempt(app, store, active, line_no, attempt)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        outage = app.get(DATABASE_OUTAGE)
        if outage is None or not outage.report(exc, f"batch {batch_id} line {line_no}"):
            log.exception("batch %s line %d failed unexpectedly", batch_id, line_no)
        with contextlib.suppress(Exception):  # the database may be what failed
            await settle_failure(store, cfg, active, line_no, internal_error(), attempt)
        return None


async def _run_attempt(
    app: web.Application, store: BatchStore, active: ActiveBatch, line_no: int, attempt: int
) -> int | None:
    """The line's request, marked running as its attempt number *attempt*, through the
    pipeline; commits the result (or settles the failure)."""
    batch_id = active.info.id
    prepared = active.prepared[line_no]
    flight = Flight(
        principal=batch_principal(active),
        origin="batch",
        endpoint=active.kind,
        model=app[CONFIG].model.name,
    )
    if active.stopping is not None:
        return None  # wound down while the line was being marked: it never runs
    with recording(app, flight):
        prepare(app, flight, prepared.body, prepared.prompt)
        call = asyncio.ensure_future(complete(app, flight))
        active.calls[line_no] = call
        try:
            result = await call
        except asyncio.CancelledError:
            if active.stopping is not None:  # the usage record says why it stopped
                flight.fail(_STOPPED[active.stopping]())
            task = asyncio.current_task()
            if call.cancelled() and task is not None and not task.cancelling():
                return None  # the call was stopped (the batch winds down): nothing to write
            raise
        finally:
            active.calls.pop(line_no, None)
    if not isinstance(result, Completion):
        await settle_failure(store, app[CONFIG].batch, active, line_no, result, attempt)
        return None
    active.down_streak = 0  # the engine answers: retries need no back-off
    request = flight.request  # as admitted (admission may change a request's terms)
    assert request is not None
    head = ResponseHead(
        endpoint=active.kind,
        rid=request.rid,
        model=flight.model,
        logprobs=request.asks_logprobs,
        tool_plan=request.tool_plan,
    )
    usage = usage_body(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
    body = completion_body(head, result.text, result.finish_reason, usage, result.logprobs)
    await store.finish_item(
        batch_id,
        line_no,
        ItemResult(
            status="succeeded",
            response={"status_code": 200, "request_id": request.rid, "body": body},
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
        ),
    )
    return result.completion_tokens


_STOPPED: dict[str, Callable[[], Failure]] = {
    "closing": interrupted,  # the gateway stops: the line runs again after the restart
    "cancelled": client_disconnected,  # the tenant cancelled its batch
    "expired": batch_expired,
}
"""The usage record's failure of a line stopped while it ran, by `ActiveBatch.stopping`."""


async def settle_failure(
    store: BatchStore,
    cfg: BatchConfig,
    active: ActiveBatch,
    line_no: int,
    failure: Failure,
    attempt: int,
) -> None:
    """A line that did not complete on its attempt number *attempt* (`batch_items.attempts`
    with this one; 0 when the line failed before it was counted): to the error file when
    retrying cannot help; otherwise back to pending.

    An engine that was unreachable (or refused the line for capacity) only delays it, however
    long it takes: the attempt is given back. Any other retryable failure — the engine aborted
    it, went away while it ran (`is_engine_lost`), a quota, a gateway error — keeps the
    attempt, and the line's `batch.max_attempts`-th goes to the error file: with its own error,
    or, when the engine went away, `attempts_exhausted` (it may be what crashes the engine)."""
    batch_id = active.info.id
    if not failure.retryable:
        await store.finish_item(batch_id, line_no, refusal(failure))
        return
    down = failure.kind == "engine_unavailable"
    never_reached = down and not failure.is_engine_lost
    if not never_reached and attempt >= cfg.max_attempts:
        last = attempts_exhausted(attempt) if failure.is_engine_lost else failure
        await store.finish_item(batch_id, line_no, refusal(last))
        return
    await store.requeue_item(batch_id, line_no, is_attempt_refunded=never_reached)
    active.down_streak = active.down_streak + 1 if down else 0
    pause = cfg.retry_after_s * (2 ** min(active.down_streak, 4) if down else 1)
    active.retry.append((time.monotonic() + pause, line_no))


def batch_principal(active: ActiveBatch) -> Principal:
    """The batch's tenant, with the time left to its deadline as the BE deadline."""
    tenant = active.tenant
    deadline = active.info.deadline_at
    if deadline is not None:
        left = max(1.0, (deadline - now_utc()).total_seconds())
        tenant = msgspec.structs.replace(
            tenant, slo=msgspec.structs.replace(tenant.slo, deadline_s=left)
        )
    elif tenant.slo.deadline_s is not None:
        # The contract's deadline is per job: it counts from the batch's creation.
        left = tenant.slo.deadline_s - (now_utc() - active.info.created_at).total_seconds()
        tenant = msgspec.structs.replace(
            tenant, slo=msgspec.structs.replace(tenant.slo, deadline_s=max(1.0, left))
        )
    return Principal(tenant=tenant, key_id=active.info.key_id or "", key_prefix="batch")


def refusal(failure: Failure) -> ItemResult:
    """A line that failed for good: an error-file line with the status and error body a client
    of the API would have got."""
    body = failure.api_error().body()
    response: dict[str, Any] = {
        "status_code": failure.http_status,
        "request_id": None,
        "body": body,
    }
    return ItemResult(status="failed", response=response)
