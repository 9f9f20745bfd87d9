"""The batch runner: validates new batches, feeds their lines to the engine in the prefix-tree
order, writes every result to SQL as it arrives, and finalizes, expires and cancels batches.

Durability: a line's life is a row (pending → running → succeeded | failed). Results are
committed one by one, and the output file is built only at the end from the rows, in file order,
one line per row (unique per custom_id), so a crash at any point loses at most the lines that
were running (they go back to pending at start-up and run again, their interrupted attempt
counted: a line in flight at every crash ends in the error file after `batch.max_attempts`) and
can never duplicate one. A gateway stopped by a signal loses fewer: its drain starts no line and
lets those in flight finish, up to `gateway.shutdown_timeout_s` (`stop_starting`,
gateway/shutdown.py); only the lines still running then are stopped (`close`) and run again.
Running one line and committing its result (or its retry) is gateway/batch/execute.py.

Backpressure: at most `batch.max_inflight` lines per serving engine are running at once (all
batches together), and each batch's feed (backend/policy/batch_order/feed.py) keeps its lines'
estimated KV footprint within the engines' KV pools, so BE work queues here, in SQL, not inside
the engine, where it would sit in front of RT requests' memory.

RT first: while the engine reports RT requests waiting (`EngineLoad.num_rt_waiting` > 0, from the
gateway's `LoadWatcher`; in a pool, while every serving engine does: `pool_dispatch_paused`), no
new line is sent (`be_dispatch_paused`); the lines on the engine run
on (its policy evicts BE for RT as it needs), and the paused ones keep their place in their feed
and their deadline — they are only sent later, when the report shows the RT queue empty (the
runner's poll looks again every `batch.poll_interval_s`). Without a watcher (stock SGLang, or
its reports down) nothing pauses.

Order across batches (gateway/batch/fair.py): among tenants, weighted fair share — the next
line comes from the tenant with the least weighted tokens sent (prompt at dispatch, output at
finish), so one tenant's large batch cannot hold another's back; among one tenant's batches,
earliest deadline first (a short completion window or the tenant's BE deadline), then the
earliest expiry; within a batch, its feed's (prefix-tree) order. Deadline-carrying lines tell
the engine the time left, so its policy can rush them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

import msgspec
from aiohttp import web
from sqlalchemy.exc import InterfaceError, OperationalError

from backend.policy.batch_order.feed import BatchFeed, FeedSettings
from backend.policy.batch_order.tree import OrderItem
from common.wire import EngineLoad
from gateway.api.schemas import CompletionRequest, Endpoint
from gateway.batch.execute import ActiveBatch, execute_line, refusal, settle_failure
from gateway.batch.fair import TenantShares, tenant_weight
from gateway.batch.lines import now_utc
from gateway.batch.output import build_files
from gateway.batch.prepare import PreparedLine, prepare_lines
from gateway.batch.store import BatchStore
from gateway.batch.types import ENDPOINTS, BatchInfo, PendingItem
from gateway.batch.validate import validate_lines
from gateway.pipeline.outcome import Failure, internal_error
from gateway.pipeline.placement import engine_candidates
from gateway.state import CONFIG, LOADS, POOL, STORE, TOKENIZER
from gateway.store.outage import DATABASE_OUTAGE, DatabaseOutage
from gateway.store.types import Tenant
from gateway.tokenizer import ModelTokenizer

log = logging.getLogger(__name__)

_CLOSE_WAIT_S = 15.0
"""How long closing waits for the loop's tick and the lines' last writes, s."""

_ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
_PREPARE_CHUNK_LINES = 256
"""Lines tokenized before their token ids are compacted (`_prepare_compact`)."""


def be_dispatch_paused(load: EngineLoad | None) -> bool:
    """Whether the runner holds its lines back: the engine's newest report shows RT requests
    waiting (BE is paused before RT ever waits for it). No report (no watcher, or the engine's
    reports down): False — nothing to go by, and the engine's policy still puts RT first."""
    return load is not None and load.num_rt_waiting > 0


def pool_dispatch_paused(app: web.Application) -> bool:
    """`be_dispatch_paused` for the engines lines may be placed on (the pool's serving ones):
    held back only while every one of them shows RT requests waiting — a line sent then would
    wait behind RT wherever it went. With one engine, that engine's report decides."""
    watchers = app.get(LOADS) or {}
    loads = [
        watcher.latest if (watcher := watchers.get(handle.name)) is not None else None
        for handle in engine_candidates(app)
    ]
    if len(loads) == 1 and loads[0] is None and len(watchers) == 1:
        loads = [next(iter(watchers.values())).latest]  # one engine, its watcher named otherwise
    return bool(loads) and all(be_dispatch_paused(load) for load in loads)


def _prepare_compact(
    pending: list[PendingItem],
    kind: Endpoint,
    tokenizer: ModelTokenizer,
    model: str,
    default_max_tokens: int,
) -> tuple[dict[int, PreparedLine], dict[int, Failure]]:
    """`prepare_lines`, with every prompt's token ids sharing one int object per id.

    A batch's prepared lines stay in memory while it runs (the feed's prefix tree holds their
    prompts), and the tokenizer returns a fresh int object for every token id: 36 bytes a
    token, 14 kB for a 355-token prompt, about 700 MB for a 50,000-line batch. Drawn from one
    table of the ids' int objects, a token costs the list's 8-byte pointer (4.7 kB for that
    line, its body included). Lines are prepared a chunk at a time, so the fresh ints of only
    one chunk exist at once. CPU work: call it in a worker thread."""
    ints = list(range(tokenizer.vocab_size))
    prepared: dict[int, PreparedLine] = {}
    refused: dict[int, Failure] = {}
    for start in range(0, len(pending), _PREPARE_CHUNK_LINES):
        chunk = pending[start : start + _PREPARE_CHUNK_LINES]
        lines, failures = prepare_lines(chunk, kind, tokenizer, model, default_max_tokens)
        refused.update(failures)
        for line_no, line in lines.items():
            ids = line.prompt.input_ids
            if len(ids) > 1 and max(ids) < len(ints):  # (itemgetter of one id: no tuple)
                shared = list(operator.itemgetter(*ids)(ints))
                body = line.body
                if isinstance(body, CompletionRequest) and body.prompt == ids:
                    body = msgspec.structs.replace(body, prompt=shared)  # token ids: one copy
                line = PreparedLine(body=body, prompt=replace(line.prompt, input_ids=shared))
            prepared[line_no] = line
    return prepared, refused


class BatchRunner:
    """Runs in the gateway process (one per database; see `batch.runner_enabled`)."""

    def __init__(
        self,
        app: web.Application,
        store: BatchStore,
        *,
        weight_of: Callable[[Tenant], float] = tenant_weight,
    ) -> None:
        self._app = app
        self._store = store
        self._config = app[CONFIG]
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._active: dict[str, ActiveBatch] = {}
        self._inflight = 0
        self._shares = TenantShares()
        self._weight_of = weight_of
        """A tenant's fair-share weight (its contract's, 1.0 where it has none)."""
        self._paused = False
        """Whether the last dispatch held the lines back for RT (`be_dispatch_paused`)."""
        self._closing = False
        """Set by `close`: the loop ends after its tick, and no line starts."""
        self._draining = False
        """Set by `stop_starting` (the gateway drains): no line starts, those in flight run on."""
        self._no_lines = asyncio.Event()
        """Set while no line is in flight."""
        self._no_lines.set()
        self._replans: dict[str, asyncio.Task[None]] = {}
        """Re-plans running in a worker thread, by batch id."""
        self._outage = app.get(DATABASE_OUTAGE) or DatabaseOutage()
        """Database failures, logged once per outage (gateway/store/outage.py)."""

    async def start(self) -> None:
        """Resumes what a previous process left running, then starts the loop."""
        reset = await self._store.reset_running()
        if reset:
            log.info(
                "batch runner: %d lines left running by a previous process are pending again", reset
            )
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def close(self) -> None:
        """Stops the loop and the lines in flight: their engine requests are aborted and they
        stay `running` in SQL, so the next start runs them again; a line whose answer is in
        writes it. Nothing is cancelled inside a database write (ActiveBatch.tasks)."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            # the loop ends after its current tick; cancelled only if that tick hangs
            done, _ = await asyncio.wait([self._task], timeout=_CLOSE_WAIT_S)
            if not done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        tasks = [t for a in self._active.values() for t in a.tasks.values()]
        for active in self._active.values():
            active.stopping = active.stopping or "closing"
            for call in list(active.calls.values()):
                call.cancel()
        for replan in self._replans.values():
            replan.cancel()  # planning in a worker thread: no database
        tasks += self._replans.values()
        if tasks:
            await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)

    def wake(self) -> None:
        """Something changed (a new or cancelled batch): look now, not at the next poll."""
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Lines running now (sent to the engine, or about to be)."""
        return self._inflight

    def stop_starting(self) -> None:
        """The gateway drains before it stops (gateway/shutdown.py): from now on no line starts,
        not even a retry, while those in flight run on and write their outcome. The loop goes on
        ticking, so a batch whose last lines finish now completes. What is still running at
        `close` is stopped there and runs again after the restart."""
        self._draining = True

    async def lines_done(self) -> None:
        """Returns once no line is in flight."""
        await self._no_lines.wait()

    async def _loop(self) -> None:
        interval = self._config.batch.poll_interval_s
        while not self._closing:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep running: one bad batch must not stop the others
                if not self._outage.report(exc, "batch runner"):
                    log.exception("batch runner tick failed")
            if self._closing:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            self._wake.clear()

    async def _tick(self) -> None:
        for info in await self._store.batches_with_status(_ACTIVE_STATUSES):
            try:
                await self._advance(info)
            except (asyncio.CancelledError, OperationalError, InterfaceError, OSError):
                raise  # stopping, or the database is down for every batch: the loop waits
            except Exception:  # one batch that cannot advance must not hold the others back
                log.exception("batch %s could not advance", info.id)
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
        items, errors = await asyncio.to_thread(validate_lines, content, info.endpoint, kind)
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
            _prepare_compact,
            pending,
            kind,
            self._app[TOKENIZER],
            self._config.model.name,
            self._config.gateway.default_max_tokens,
        )
        for line_no, failure in refused.items():  # prompts the model cannot take: error file
            if await self._store.mark_running(info.id, line_no):
                await self._store.finish_item(info.id, line_no, refusal(failure))
        items = [
            OrderItem(
                index=n,
                path=p.prompt.input_ids,
                prompt_len=len(p.prompt.input_ids),
                max_output_len=p.prompt.max_tokens,
            )
            for n, p in prepared.items()
        ]
        settings = await self._feed_settings(tenant)
        # planning 50,000 lines takes a second or more: not on the loop that serves requests
        feed = await asyncio.to_thread(
            BatchFeed, items, settings, known_output=known, defer_replans=True
        )
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
        # a pool of N engines holds N KV pools and runs N engines' lines (the dispatch bounds
        # the lines on the engines that serve now)
        pool = self._app.get(POOL)
        engines = max(1, len(pool) if pool is not None else 0)
        kv = (cfg.engine_kv_tokens or self._config.engine.max_total_tokens) * engines
        history = await self._app[STORE].length_history(
            tenant.id, self._config.usage.length_history_window
        )
        prior = sum(history) / len(history) if history else FeedSettings.prior_output_len
        return FeedSettings(
            ordering="blend",
            memory_tokens=float(kv),
            prior_output_len=prior,
            max_inflight=cfg.max_inflight * engines,
            pilot_fraction=cfg.pilot_fraction,
            pilot_max_lines=cfg.pilot_max_lines,
            split_alpha=cfg.split_alpha,
        )

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        """Starts lines while the global bound allows: tenants by fair share, a tenant's
        batches most urgent first; none while RT waits on the engine (module docstring)."""
        if self._closing or self._draining:
            return
        paused = pool_dispatch_paused(self._app)
        if paused != self._paused:
            self._paused = paused
            log.info(
                "batch runner: %s",
                "paused: RT requests wait on the engine" if paused else "resumed: no RT waits",
            )
        if paused:
            return
        by_tenant: dict[str, list[ActiveBatch]] = {}
        for active in sorted(self._active.values(), key=lambda a: a.priority):
            if active.stopping is None:
                by_tenant.setdefault(active.info.tenant_id, []).append(active)
        self._shares.set_backlogged(by_tenant)
        # the bound is per engine: a pool of N serves N times the lines (one engine's bound
        # spread over N would leave each nearly idle of batch work)
        engines = max(1, len(engine_candidates(self._app)))
        room = self._config.batch.max_inflight * engines - self._inflight
        for active, line_no in self._shares.pick_lines(by_tenant, self._next_line, room):
            prompt_tokens = len(active.prepared[line_no].prompt.input_ids)
            self._shares.charge(
                active.info.tenant_id, prompt_tokens, self._weight_of(active.tenant)
            )
            self._inflight += 1
            self._no_lines.clear()
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
            output_len = await execute_line(self._app, self._store, active, line_no)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # before the attempt was counted (execute_line settles the rest)
            if not self._outage.report(exc, f"batch {active.info.id} line {line_no}"):
                log.exception("batch %s line %d failed unexpectedly", active.info.id, line_no)
            with contextlib.suppress(Exception):  # the database may be what failed
                await settle_failure(
                    self._store, self._config.batch, active, line_no, internal_error(), attempt=0
                )
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._no_lines.set()
            active.tasks.pop(line_no, None)
            if output_len:
                self._shares.charge(
                    active.info.tenant_id, output_len, self._weight_of(active.tenant)
                )
            active.feed.finished(line_no, output_len)  # retries bypass the feed
            due = active.feed.replan_due and not self._closing
            if due and active.info.id not in self._replans:
                self._replans[active.info.id] = asyncio.create_task(self._replan(active))
            self._wake.set()

    async def _replan(self, active: ActiveBatch) -> None:
        """Re-plans a batch's feed in a worker thread (pilot results came in); the feed goes on
        with its current plan meanwhile."""
        try:
            draft = await asyncio.to_thread(active.feed.draft_replan())
            active.feed.adopt(draft)
        except Exception:  # the current plan still holds every line
            log.exception("batch %s: re-planning failed", active.info.id)
        finally:
            self._replans.pop(active.info.id, None)
            self._wake.set()

    # ------------------------------------------------------------------ endings

    async def _maybe_done(self, active: ActiveBatch) -> None:
        if active.tasks or active.retry or not active.feed.exhausted:
            return
        if await self._store.count_unfinished(active.info.id):
            await self._requeue_untracked(active)
            return
        if await self._store.set_status(active.info.id, "finalizing", expect=("in_progress",)):
            await self._finalize(active.info.id, "completed")

    async def _requeue_untracked(self, active: ActiveBatch) -> None:
        """Runs again the lines SQL still shows unfinished although nothing here runs or waits
        for them: lines whose outcome could not be written (the database failed while they ran,
        leaving them `running`, or before they were marked, leaving them `pending`). Called only
        when the batch has no line in flight, none waiting for a retry and none left in its
        feed, so every unfinished line is such a one; no line starts meanwhile (dispatching
        happens in this same loop). Their interrupted attempt stays counted, as after a
        restart."""
        batch_id = active.info.id
        reset = await self._store.reset_batch_running(batch_id)
        lines = [item.line_no for item in await self._store.pending_items(batch_id)]
        known = [n for n in lines if n in active.prepared]
        now = time.monotonic()
        active.retry.extend((now, line_no) for line_no in known)
        log.warning(
            "batch %s: %d lines whose outcome was never written run again (%d were left running)",
            batch_id,
            len(known),
            reset,
        )
        if len(known) < len(lines):  # not prepared here (a line added since?): load afresh
            self._active.pop(batch_id, None)

    async def _wind_down(self, info: BatchInfo, active: ActiveBatch | None, final: str) -> None:
        """Expiry or cancellation: nothing new starts, running lines are stopped, the rest is
        marked, and the batch finalizes with what finished."""
        if active is not None:
            active.stopping = final
            tasks = list(active.tasks.values())
            for call in list(active.calls.values()):
                call.cancel()  # the engine request: its line's task ends without a write
            if tasks:
                # never cancelled (ActiveBatch.tasks): each ends after its write, if any
                await asyncio.wait(tasks)
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
