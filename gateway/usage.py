"""Usage records and output-length history, written off the hot path.

Handlers call `UsageRecorder.record()` (no await, no I/O); a background task drains the queue in
batches, one transaction per batch, every `flush_interval_s` or sooner when a batch fills. If the
database is down, records stay queued (up to `queue_max`; beyond it the oldest are dropped and
counted in `dropped`) and the write is retried, so a database hiccup loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from datetime import UTC, datetime

from common.config import UsageConfig
from gateway.store.outage import DatabaseOutage
from gateway.store.repo import Store
from gateway.store.types import UsageRecord

log = logging.getLogger(__name__)
_RETRY_DELAY_S = 1.0


class UsageRecorder:
    """Buffers finished requests' records and writes them in batches."""

    def __init__(
        self, store: Store, config: UsageConfig, outage: DatabaseOutage | None = None
    ) -> None:
        self._store = store
        self._config = config
        self._outage = outage or DatabaseOutage()
        """Database failures, logged once per outage (gateway/store/outage.py)."""
        self._records: collections.deque[UsageRecord] = collections.deque()
        self._lengths: collections.deque[tuple[str, int, int | None]] = collections.deque()
        self._used_key_ids: set[str] = set()
        self._wakeup = asyncio.Event()
        # one writer at a time: a flush from close() or a caller must not race the background
        # task over the same queued records (they would be written twice)
        self._write_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.dropped = 0
        """Records dropped because the queue overflowed (the database was down too long)."""

    def record(
        self, record: UsageRecord, *, length_key: str | None = None, key_id: str | None = None
    ) -> None:
        """Queues one request's record; *length_key* adds its output length to the history."""
        if len(self._records) >= self._config.queue_max:
            self._records.popleft()
            self.dropped += 1
        self._records.append(record)
        if length_key is not None and record.status == "ok":
            self._lengths.append((length_key, record.completion_tokens, record.prompt_tokens))
        if key_id is not None:
            self._used_key_ids.add(key_id)
        if len(self._records) >= self._config.batch_size:
            self._wakeup.set()

    @property
    def pending(self) -> int:
        return len(self._records)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-recorder")

    async def close(self) -> None:
        """Writes everything still queued, then stops."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        try:
            await self.flush()
        except Exception:
            log.exception("shutting down with %d usage records unwritten", len(self._records))

    async def flush(self) -> None:
        """Writes all queued records now (one transaction per batch)."""
        async with self._write_lock:
            while self._records or self._lengths or self._used_key_ids:
                await self._write_batch()

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self._config.flush_interval_s)
            self._wakeup.clear()
            try:
                await self.flush()
            except Exception as exc:  # the database may be down: keep the records, retry later
                if not self._outage.report(exc, "writing usage records"):  # else: once an outage
                    log.exception("writing usage records failed; %d queued", len(self._records))
                await asyncio.sleep(_RETRY_DELAY_S)

    async def _write_batch(self) -> None:
        # each kind is dropped from its queue only after its own write succeeded, so a failure
        # keeps it queued and nothing is written twice
        n = min(len(self._records), self._config.batch_size)
        if n:
            await self._store.insert_usage([self._records[i] for i in range(n)])
            for _ in range(n):
                self._records.popleft()
        m = min(len(self._lengths), self._config.batch_size)
        if m:
            lengths = [self._lengths[i] for i in range(m)]
            await self._store.append_lengths(lengths, self._config.length_history_window)
            for _ in range(m):
                self._lengths.popleft()
        if self._used_key_ids:
            key_ids = set(self._used_key_ids)
            await self._store.touch_keys(key_ids, datetime.now(UTC))
            self._used_key_ids -= key_ids
