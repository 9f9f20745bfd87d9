"""The usage recorder writes every record exactly once, off the hot path, and survives a
database outage."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from common.config import UsageConfig
from gateway.store.types import UsageRecord
from gateway.usage import UsageRecorder
from tests.waiting import wait_until

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def record(n: int, status: str = "ok") -> UsageRecord:
    return UsageRecord(
        request_id=f"r{n}",
        tenant_id="t",
        tier="rt",
        model="m",
        endpoint="chat",
        status=status,
        http_status=200,
        completion_tokens=n,
        created_at=NOW,
        finished_at=NOW,
    )


class SlowStore:
    """Writes take a while (so flushes overlap); can be made to fail."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.lengths: list[tuple[str, int, int | None]] = []
        self.failing = False
        self.failed_writes = 0

    async def insert_usage(self, records: list[UsageRecord]) -> None:
        await asyncio.sleep(0.01)  # the behaviour: a slow write, so that flushes overlap
        if self.failing:
            self.failed_writes += 1
            raise ConnectionError("database down")
        self.rows.extend(r.request_id for r in records)

    async def append_lengths(self, rows: Any, window: int) -> None:
        self.lengths.extend(rows)

    async def touch_keys(self, key_ids: Any, when: datetime) -> None:
        pass


async def test_concurrent_flushes_write_each_record_once() -> None:
    store = SlowStore()
    recorder = UsageRecorder(store, UsageConfig(flush_interval_s=0.001, batch_size=3))  # type: ignore[arg-type]
    recorder.start()
    for n in range(20):
        recorder.record(record(n), length_key="t")
        if n % 5 == 0:
            await asyncio.gather(recorder.flush(), recorder.flush())
    await recorder.close()
    assert sorted(store.rows) == sorted(f"r{n}" for n in range(20))
    assert len(store.lengths) == 20


async def test_records_survive_a_database_outage() -> None:
    store = SlowStore()
    store.failing = True
    recorder = UsageRecorder(store, UsageConfig(flush_interval_s=0.01))  # type: ignore[arg-type]
    recorder.start()
    for n in range(5):
        recorder.record(record(n))
    await wait_until(lambda: store.failed_writes >= 2, timeout_s=5, what="two failed flushes")
    assert store.rows == [] and recorder.pending == 5
    store.failing = False
    await recorder.close()
    assert sorted(store.rows) == [f"r{n}" for n in range(5)]


async def test_failed_requests_add_no_output_length() -> None:
    store = SlowStore()
    recorder = UsageRecorder(store, UsageConfig())  # type: ignore[arg-type]
    recorder.record(record(1, status="engine_unavailable"), length_key="t")
    await recorder.flush()
    assert store.rows == ["r1"] and store.lengths == []
