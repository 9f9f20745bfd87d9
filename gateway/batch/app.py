"""Wiring of the Files and Batch API into the gateway: typed app keys and the cleanup context
that owns the batch store and the runner (gateway/app.py registers both)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from gateway.batch.leader import BatchLeadership
from gateway.batch.store import BatchStore
from gateway.engine.sampler import gauge
from gateway.state import CONFIG, DB_ENGINE, METRICS
from gateway.store.db import session_factory

BATCH_STORE = web.AppKey("batch_store", BatchStore)
BATCH_LEADER: web.AppKey[BatchLeadership | None] = web.AppKey("batch_leader")
"""Whether and when this process runs the batches (gateway/batch/leader.py: elected through
PostgreSQL, always on SQLite); None where `batch.runner_enabled` is false."""


async def batch_context(app: web.Application) -> AsyncIterator[None]:
    """Creates the batch store and runs for the batch runner's leadership (gateway/batch/
    leader.py); stops the runner on shutdown (lines in flight stay `running` in SQL and resume
    at the next start, here or on another gateway)."""
    store = BatchStore(session_factory(app[DB_ENGINE]))
    app[BATCH_STORE] = store
    leadership = BatchLeadership(app, store) if app[CONFIG].batch.runner_enabled else None
    app[BATCH_LEADER] = leadership
    if leadership is not None:
        if METRICS in app:
            app[METRICS].extra.append(
                lambda: iter(
                    [
                        gauge(
                            "tandem_batch_leader",
                            "1 while this gateway process runs the batches (it holds the "
                            "leader lock; always on SQLite), else 0.",
                            float(leadership.is_leader),
                        )
                    ]
                )
            )
        await leadership.start()
    yield
    if leadership is not None:
        await leadership.close()


def wake_runner(app: web.Application) -> None:
    """Tells this process's runner to look at the batches now (no-op where it does not lead:
    the leader's poll finds them within `batch.poll_interval_s`)."""
    leadership = app[BATCH_LEADER]
    if leadership is not None:
        leadership.wake()
