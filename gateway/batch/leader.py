"""Which gateway process runs the batches: one per database, elected through PostgreSQL.

Several `tandem serve` processes may share one PostgreSQL database (gateway replicas behind a
TCP load balancer): each accepts batches through the API, but exactly one, the leader, runs
them (gateway/batch/runner.py), so that no line runs twice. The leader is whoever holds the
PostgreSQL advisory lock `LOCK_KEY`, taken with ``pg_try_advisory_lock`` on a dedicated
connection held for as long as it leads (a session lock: it is released when that connection
ends, for whatever reason):

* every process with ``batch.runner_enabled`` tries to take the lock at start and then every
  `TRY_INTERVAL_S` while another holds it;
* the one that gets it starts its runner, which first puts back to `pending` the lines a
  previous leader left `running` (`BatchStore.reset_running`: their attempt stays counted, as
  after a restart) and then resumes every active batch from SQL;
* a leader that dies (a crash, SIGKILL) loses its connection and with it the lock at once, the
  database noticing the closed socket: another process takes over at its next try, within
  `TRY_INTERVAL_S` or so, and every line ends exactly once (results are committed per line, the
  output file is built from the rows);
* a leader stopped by a signal first drains: it starts no line, lets those in flight finish
  (gateway/shutdown.py), then stops its runner and releases the lock; a process that is
  stopping never takes the lock;
* a leader whose lock connection fails (checked every `CHECK_INTERVAL_S`) can no longer be sure
  it leads: it stops its runner (its lines' engine requests are aborted and stay `running` for
  the next leader) and tries again.

On SQLite a database serves one gateway process: it is always the leader, without a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import asyncpg
from aiohttp import web

from gateway.auth_sync import asyncpg_dsn
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.state import CONFIG
from gateway.store.db import is_sqlite
from gateway.store.outage import DATABASE_OUTAGE

log = logging.getLogger(__name__)

LOCK_KEY = 0x74616E64656D4252  # "tandemBR": the batch runner's advisory lock, one per database
"""The advisory lock whose holder runs the batches (a bigint; no other tandem lock uses it)."""
TRY_INTERVAL_S = 1.0
"""How often a process that does not lead tries to take the lock, seconds: how long a dead
leader's batches wait for the next one, at most (plus the database noticing the death)."""
CHECK_INTERVAL_S = 2.0
"""How often the leader checks that its lock connection is alive, seconds."""
_QUERY_TIMEOUT_S = 10.0
_RETRY_MAX_S = 10.0
APPLICATION_NAME = "tandem-batch-leader"
"""The lock connection's `application_name` (what pg_stat_activity shows)."""


class BatchLeadership:
    """Runs the batch runner while this process leads (see the module docstring)."""

    def __init__(self, app: web.Application, store: BatchStore) -> None:
        self._app = app
        self._store = store
        url = app[CONFIG].database.url
        self._dsn = None if is_sqlite(url) else asyncpg_dsn(url)
        self.runner: BatchRunner | None = None
        """This process's runner while it leads; None otherwise."""
        self._task: asyncio.Task[None] | None = None
        self._led = asyncio.Event()
        self._draining = False
        """Set by `stop_starting`: the gateway stops, and leading now would start lines."""

    @property
    def is_leader(self) -> bool:
        """Whether this process runs the batches now."""
        return self.runner is not None

    async def start(self) -> None:
        """Leads at once on SQLite; on PostgreSQL starts trying for the lock (and waits briefly
        for the first try, so a lone gateway leads by the time it serves)."""
        if self._dsn is None:
            await self._lead()
            return
        self._task = asyncio.create_task(self._elect(self._dsn), name="batch-leader")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._led.wait()), TRY_INTERVAL_S * 3)

    async def close(self) -> None:
        """Stops trying, stops the runner (lines in flight stay `running` for the next leader)
        and gives up the lock."""
        await self._step_down()  # first: no line of ours runs once the lock is released
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._step_down()  # a runner the election started meanwhile

    def wake(self) -> None:
        """Tells the runner, if this process leads, to look at the batches now."""
        if self.runner is not None:
            self.runner.wake()

    def stop_starting(self) -> BatchRunner | None:
        """The gateway drains before it stops: the runner, if this process leads, starts no
        more lines (`BatchRunner.stop_starting`), and a process that does not lead no longer
        takes the lead. Returns that runner (None where this process does not lead), whose
        lines in flight the drain waits for."""
        self._draining = True
        if self.runner is not None:
            self.runner.stop_starting()
        return self.runner

    async def _lead(self) -> None:
        if self._draining:
            return  # stopping: the batches wait for a leader that stays
        runner = BatchRunner(self._app, self._store)
        await runner.start()
        self.runner = runner
        self._led.set()

    async def _step_down(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            await runner.close()

    async def _elect(self, dsn: str) -> None:
        retry_s = TRY_INTERVAL_S
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(
                    dsn,
                    timeout=_QUERY_TIMEOUT_S,
                    server_settings={"application_name": APPLICATION_NAME},
                )
                retry_s = TRY_INTERVAL_S
                # (a draining process no longer tries: it would hold the lock while it stops)
                while self._draining or not await conn.fetchval(
                    "SELECT pg_try_advisory_lock($1)", LOCK_KEY, timeout=_QUERY_TIMEOUT_S
                ):
                    self._led.set()  # the first try is over: another process leads
                    await asyncio.sleep(TRY_INTERVAL_S)
                log.info("batch runner: this gateway leads (advisory lock taken); resuming batches")
                await self._lead()
                while True:  # lead while the lock's connection lives
                    await asyncio.sleep(CHECK_INTERVAL_S)
                    await conn.fetchval("SELECT 1", timeout=_QUERY_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database went away: whatever we held is gone
                # an outage is logged once, by whoever meets it first (gateway/store/outage.py)
                outage = self._app.get(DATABASE_OUTAGE)
                reported = outage is not None and outage.report(exc, "the batch leader lock")
                # "connection is closed": the lock's connection broke under it (an outage the
                # pool's users report), not a failure of its own
                reported = reported or isinstance(exc, asyncpg.exceptions.InterfaceError)
                if self.runner is not None:
                    log.log(
                        logging.INFO if reported else logging.ERROR,
                        "batch runner: lost the leader lock's connection (%s); stepping down "
                        "until it can be taken again",
                        exc,
                    )
                elif not reported:
                    log.warning("batch runner: cannot elect a leader (%s); retrying", exc)
                await self._step_down()
                self._led.set()
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, _RETRY_MAX_S)
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(conn.close(timeout=5))
