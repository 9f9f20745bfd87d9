"""Wiring of the Files and Batch API into the gateway: typed app keys and the cleanup context
that owns the batch store and the runner (gateway/app.py registers both)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.state import CONFIG, DB_ENGINE
from gateway.store.db import session_factory

BATCH_STORE = web.AppKey("batch_store", BatchStore)
BATCH_RUNNER: web.AppKey[BatchRunner | None] = web.AppKey("batch_runner")
"""The runner, or None where `batch.runner_enabled` is false (another process runs batches)."""


async def batch_context(app: web.Application) -> AsyncIterator[None]:
    """Creates the batch store and starts the runner; stops the runner on shutdown (lines in
    flight stay `running` in SQL and resume at the next start)."""
    store = BatchStore(session_factory(app[DB_ENGINE]))
    app[BATCH_STORE] = store
    runner = BatchRunner(app, store) if app[CONFIG].batch.runner_enabled else None
    app[BATCH_RUNNER] = runner
    if runner is not None:
        await runner.start()
    yield
    if runner is not None:
        await runner.close()


def wake_runner(app: web.Application) -> None:
    """Tells this process's runner to look at the batches now (no-op without a runner)."""
    runner = app[BATCH_RUNNER]
    if runner is not None:
        runner.wake()
