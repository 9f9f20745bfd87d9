"""The batch runner: validates new batches, feeds their lines to the engine in the prefix-tree
order, writes every result to SQL as it arrives, and finalizes, expires and cancels batches.

Durability: a line's life is a row (pending → running → succeeded | failed). Results are
committed one by one, and the output file is built only at the end from the rows, in file order,
one line per row (unique per custom_id), so a crash at any point loses at most the lines that
were running (they go back to pending at start-up and run again) and can never duplicate one.

Backpressure: at most `batch.max_inflight` lines are on the engine at once (all batches
together), and each batch's feed (gateway/batch/order/feed.py) keeps its lines' estimated KV
footprint within the engine's KV pool, so BE work queues here, in SQL, not inside the engine,
where it would sit in front of RT requests' memory.

Order across batches: earliest deadline first (a short completion window or the tenant's BE
deadline), then the earliest expiry. Deadline-carrying lines tell the engine the time left, so
its policy can rush them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import msgspec
from aiohttp import web

from gateway.api.generation import Generation, is_cancellation
from gateway.api.prepare import (
    build_engine_request,
)
from gateway.auth import Principal
from gateway.batch.lines import now_utc
from gateway.batch.order.feed import BatchFeed, FeedSettings
from gateway.batch.order.tree import OrderItem
from gateway.batch.output import build_files, completion_body
from gateway.batch.prepare import PreparedLine, prepare_lines
from gateway.batch.store import BatchStore
from gateway.batch.types import ENDPOINTS, BatchInfo, ItemResult
from gateway.batch.validate import validate_lines
from gateway.errors import ApiError
from gateway.state import CONFIG, STORE, TOKENIZER
from gateway.store.types import Tenant

log = logging.getLogger(__name__)

_ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


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


class BatchRunner:
    """Runs in the gateway process (one per database; see `batch.runner_enabled`)."""

    def __init__(self, app: web.Application, store: BatchStore) -> None:
        self._app = app
        self._store = store
        self._config = app[CONFIG]
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._active: dict[str, ActiveBatch] = {}
        self._inflight = 0

    @property
    def inflight(self) -> int:
        """Lines on the engine now."""
        return self._inflight

    async def start(self) -> None:
        """Resumes what a previous process left running, then starts the loop."""
        reset = await self._store.reset_running()
        if reset:
            log.info(
                "batch runner: %d lines left running by a previous process are pending again", reset
            )
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def close(self) -> None:
        """Stops the loop; lines in flight are cancelled (their engine requests aborted) and
        stay `running` in SQL, so the next start runs them again."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        tasks = [t for a in self._active.values() for t in a.tasks.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    def wake(self) -> None:
        """Something changed (a new or cancelled batch): look now, not at the next poll."""
        self._wake.set()

    async def _loop(self) -> None:
        interval = self._config.batch.poll_interval_s
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep running: one bad batch must not stop the others
                log.exception("batch runner tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            self._wake.clear()

    async def _tick(self) -> None:
        for info in await self._store.batches_with_status(_ACTIVE_STATUSES):
            await self._advance(info)
        self._dispatch()

    async def _advance(self, info: BatchInfo) -> None:
        """One batch's next step by its status."""
        if info.status == "validating":
            await self._validate(info)
            return
        active = self._active.get(info.id)
        if info.status == "finalizing":
            await self._finalize(info.id, "completed")
        elif info.status == "cancelling":
            await self._wind_down(info, active, "cancelled")
        elif info.status == "in_progress":
            if now_utc() >= info.expires_at:
                await self._wind_down(info, active, "expired")
            elif active is None:
                await self._load(info)
            else:
                active.info = info
                await self._maybe_done(active)

    # ------------------------------------------------------------------ validation

    async def _validate(self, info: BatchInfo) -> None:
        content = await self._store.file_content(info.tenant_id, info.input_file_id)
        model = self._config.model.name
        if content is None:
            errors = [
                {
                    "code": "file_not_found",
                    "message": f"input file {info.input_file_id} no longer exists",
                    "param": "input_file_id",
                    "line": None,
                }
            ]
            await self._store.start(info.id, [], None, errors)
            return
        kind = ENDPOINTS[info.endpoint]
        items, errors = await asyncio.to_thread(validate_lines, content, info.endpoint, kind, model)
        status = await self._store.start(info.id, items, model, errors or None)
        log.info("batch %s: %d lines, %s", info.id, len(items), status)
        self._wake.set()

    # ------------------------------------------------------------------ loading and planning

    async def _load(self, info: BatchInfo) -> None:
        tenant = await self._app[STORE].get_tenant(info.tenant_id, include_deleted=True)
        if tenant is None:
            return
        pending = await self._store.pending_items(info.id)
        known = await self._store.finished_lengths(info.id)
        kind = ENDPOINTS[info.endpoint]
        prepared, refused = await asyncio.to_thread(
            prepare_lines,
            pending,
            kind,
            self._app[TOKENIZER],
            self._config.model.name,
            self._config.gateway.default_max_tokens,
        )
        for line_no, exc in refused.items():  # prompts the model cannot take: error file
            if await self._store.mark_running(info.id, line_no):
                await self._store.finish_item(info.id, line_no, _refusal(info, line_no, exc))
        items = [
            OrderItem(
                index=n, path=p.input_ids, prompt_len=len(p.input_ids), max_output_len=p.max_tokens
            )
            for n, p in prepared.items()
        ]
        feed = BatchFeed(items, await self._feed_settings(tenant), known_output=known)
        active = ActiveBatch(
            info=info,
            tenant=tenant,
            kind=kind,
            feed=feed,
            prepared=prepared,
            custom_ids={p.line_no: p.custom_id for p in pending},
        )
        self._active[info.id] = active
        await self._store.set_order(
            info.id, {index: rank for rank, index in enumerate(feed.planned_order())}
        )
        log.info(
            "batch %s: feeding %d lines (%d done before), pilot %d",
            info.id,
            len(items),
            len(known),
            len(feed.pilot),
        )
        await self._maybe_done(active)

    async def _feed_settings(self, tenant: Tenant) -> FeedSettings:
        """The feed of a batch: the engine's KV pool, and the tenant's output-length history as
        the prior until the batch's own pilot lines have finished."""
        cfg = self._config.batch
        kv = cfg.engine_kv_tokens or self._config.engine.max_total_tokens
        history = await self._app[STORE].length_history(
            tenant.id, self._config.usage.length_history_window
        )
        prior = sum(history) / len(history) if history else FeedSettings.prior_output_len
        return FeedSettings(
            ordering="blend",
            memory_tokens=float(kv),
            prior_output_len=prior,
            max_inflight=cfg.max_inflight,
            pilot_fraction=cfg.pilot_fraction,
            pilot_max_lines=cfg.pilot_max_lines,
            split_alpha=cfg.split_alpha,
        )

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        """Starts lines while the global bound allows, most urgent batch first."""
        limit = self._config.batch.max_inflight
        for active in sorted(self._active.values(), key=lambda a: a.priority):
            if active.stopping is not None:
                continue
            while self._inflight < limit:
                line_no = self._next_line(active)
                if line_no is None:
                    break
                self._inflight += 1
                active.tasks[line_no] = asyncio.create_task(self._run_line(active, line_no))

    def _next_line(self, active: ActiveBatch) -> int | None:
        now = time.monotonic()
        for i, (ready_at, line_no) in enumerate(active.retry):
            if ready_at <= now:
                del active.retry[i]
                return line_no
        return active.feed.next()

    async def _run_line(self, active: ActiveBatch, line_no: int) -> None:
        output_len: int | None = None
        try:
            output_len = await self._execute(active, line_no)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s line %d failed unexpectedly", active.info.id, line_no)
            with contextlib.suppress(Exception):  # the database may be what failed
                await self._retry_or_fail(
                    active,
                    line_no,
                    ApiError(
                        500, "internal error while running the request", code="internal_error"
                    ),
                )
        finally:
            self._inflight -= 1
            active.tasks.pop(line_no, None)
            active.feed.finished(line_no, output_len)  # retries bypass the feed
            self._wake.set()

    async def _execute(self, active: ActiveBatch, line_no: int) -> int | None:
        """Runs one line; returns its output length when it succeeded."""
        batch_id = active.info.id
        store = self._store
        if not await store.mark_running(batch_id, line_no):
            return None
        prepared = active.prepared[line_no]
        principal = self._principal(active)
        model = self._config.model.name
        gen = Generation(
            app=self._app,
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
                await self._retry_or_fail(active, line_no, exc)
                return None
            await store.finish_item(batch_id, line_no, _refusal(active.info, line_no, exc))
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

    async def _retry_or_fail(self, active: ActiveBatch, line_no: int, exc: ApiError) -> None:
        """An engine that is down (or restarting) only delays a line, however long it takes;
        an engine that aborts or refuses it for capacity costs an attempt, and after
        `batch.max_attempts` the line goes to the error file."""
        cfg = self._config.batch
        down = exc.code == "engine_unavailable"
        if not down:
            active.failures[line_no] = active.failures.get(line_no, 0) + 1
            if active.failures[line_no] >= cfg.max_attempts:
                await self._store.finish_item(
                    active.info.id, line_no, _refusal(active.info, line_no, exc)
                )
                return
        await self._store.requeue_item(active.info.id, line_no)
        active.down_streak = active.down_streak + 1 if down else 0
        pause = cfg.retry_after_s * (2 ** min(active.down_streak, 4) if down else 1)
        active.retry.append((time.monotonic() + pause, line_no))

    def _principal(self, active: ActiveBatch) -> Principal:
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

    # ------------------------------------------------------------------ endings

    async def _maybe_done(self, active: ActiveBatch) -> None:
        if active.tasks or active.retry or not active.feed.exhausted:
            return
        if await self._store.count_unfinished(active.info.id):
            return
        if await self._store.set_status(active.info.id, "finalizing", expect=("in_progress",)):
            await self._finalize(active.info.id, "completed")

    async def _wind_down(self, info: BatchInfo, active: ActiveBatch | None, final: str) -> None:
        """Expiry or cancellation: nothing new starts, running lines are stopped, the rest is
        marked, and the batch finalizes with what finished."""
        if active is not None:
            active.stopping = final
            tasks = list(active.tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=10)
            await self._store.reset_batch_running(info.id)
        await self._store.end_pending(info.id, final)
        await self._finalize(info.id, final)

    async def _finalize(self, batch_id: str, final: str) -> None:
        lines = await self._store.result_lines(batch_id)
        output, n_out, errors, n_err = build_files(batch_id, lines)
        expires = now_utc() + timedelta(days=self._config.batch.output_expires_days)
        done = await self._store.finalize(batch_id, final, output, errors, n_out, n_err, expires)
        self._active.pop(batch_id, None)
        if done:
            log.info("batch %s %s: %d output lines, %d error lines", batch_id, final, n_out, n_err)


def _refusal(info: BatchInfo, line_no: int, exc: ApiError) -> ItemResult:
    """A line the API refused: an error-file line with the status and error body."""
    response: dict[str, Any] = {"status_code": exc.status, "request_id": None, "body": exc.body()}
    return ItemResult(status="failed", response=response)
