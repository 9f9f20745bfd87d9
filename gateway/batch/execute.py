"""One batch line on the engine: run it, then commit its result row or put it back for a retry.

The runner (gateway/batch/runner.py) decides which line runs next; this module runs it as a BE
request of the batch's tenant and commits the outcome to SQL as it arrives: `succeeded` with the
completion body, `failed` with an error-file line, or back to `pending` with a time to retry when
the engine was down or refused it for capacity.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from aiohttp import web

from backend.policy.batch_order.feed import BatchFeed
from common.config import BatchConfig
from gateway.api.generation import Generation, is_cancellation
from gateway.api.prepare import build_engine_request
from gateway.auth import Principal
from gateway.batch.lines import now_utc
from gateway.batch.output import completion_body
from gateway.batch.prepare import PreparedLine
from gateway.batch.store import BatchStore
from gateway.batch.types import BatchInfo, ItemResult
from gateway.errors import ApiError
from gateway.state import CONFIG
from gateway.store.types import Tenant


@dataclass
class ActiveBatch:
    """An in_progress batch the runner is feeding."""

    info: BatchInfo
    tenant: Tenant
    kind: str
    """"chat" or "completions"."""
    feed: BatchFeed
    prepared: dict[int, PreparedLine]
    custom_ids: dict[int, str]
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    retry: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time when it may run again, line) of lines the engine could not take."""
    failures: dict[int, int] = field(default_factory=dict)
    """Engine aborts/refusals per line (an unreachable engine does not count)."""
    down_streak: int = 0
    """Consecutive lines that found the engine unreachable (backs the retries off)."""
    stopping: str | None = None
    """"expired" or "cancelled" once the batch is being wound down."""

    @property
    def priority(self) -> tuple[datetime, datetime]:
        """Earliest deadline first, then earliest expiry."""
        deadline = self.info.deadline_at or self.info.expires_at
        return deadline, self.info.expires_at


async def execute_line(
    app: web.Application, store: BatchStore, active: ActiveBatch, line_no: int
) -> int | None:
    """Runs one line; returns its output length when it succeeded."""
    batch_id = active.info.id
    if not await store.mark_running(batch_id, line_no):
        return None
    prepared = active.prepared[line_no]
    principal = batch_principal(active)
    config = app[CONFIG]
    model = config.model.name
    gen = Generation(
        app=app,
        principal=principal,
        endpoint=f"batch/{active.kind}",
        model=model,
        stream=False,
    )
    cancelled = False
    try:
        gen.request = build_engine_request(
            prepared.body, prepared.input_ids, prepared.max_tokens, principal, "be"
        )
        parts: list[str] = []
        async for chunk in gen.chunks():
            parts.append(chunk.text_delta)
        if gen.outcome.status == "aborted":
            raise ApiError(503, "the engine aborted the request", code="engine_aborted")
    except ApiError as exc:
        if exc.status in (429, 503):
            await retry_or_fail(store, config.batch, active, line_no, exc)
            return None
        await store.finish_item(batch_id, line_no, refusal(active.info, line_no, exc))
        return None
    except BaseException as exc:
        cancelled = is_cancellation(exc)
        raise
    finally:
        gen.close(cancelled=cancelled)
    outcome = gen.outcome
    active.down_streak = 0  # the engine answers: retries need no back-off
    body = completion_body(
        active.kind,
        gen.request.rid,
        model,
        "".join(parts),
        outcome.finish_reason,
        outcome.prompt_tokens,
        outcome.completion_tokens,
    )
    response = {"status_code": 200, "request_id": gen.request.rid, "body": body}
    await store.finish_item(
        batch_id,
        line_no,
        ItemResult(
            status="succeeded",
            response=response,
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
        ),
    )
    return outcome.completion_tokens


async def retry_or_fail(
    store: BatchStore, cfg: BatchConfig, active: ActiveBatch, line_no: int, exc: ApiError
) -> None:
    """An engine that is down (or restarting) only delays a line, however long it takes;
    an engine that aborts or refuses it for capacity costs an attempt, and after
    `batch.max_attempts` the line goes to the error file."""
    down = exc.code == "engine_unavailable"
    if not down:
        active.failures[line_no] = active.failures.get(line_no, 0) + 1
        if active.failures[line_no] >= cfg.max_attempts:
            await store.finish_item(active.info.id, line_no, refusal(active.info, line_no, exc))
            return
    await store.requeue_item(active.info.id, line_no)
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


def refusal(info: BatchInfo, line_no: int, exc: ApiError) -> ItemResult:
    """A line the API refused: an error-file line with the status and error body."""
    response: dict[str, Any] = {"status_code": exc.status, "request_id": None, "body": exc.body()}
    return ItemResult(status="failed", response=response)
