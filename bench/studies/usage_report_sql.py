"""Time of the usage report's SQL on SQLite and PostgreSQL for N usage records (default 200,000
over 30 days, 20 tenants). PostgreSQL: a scratch database on 127.0.0.1:5432, dropped afterwards.
.venv/bin/python -m bench.studies.usage_report_sql [N]"""

import asyncio
import random
import secrets
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta

import asyncpg

from gateway.reports import usage_report
from gateway.store import Store, create_engine, session_factory, upgrade_async
from gateway.store.types import UsageRecord

END = datetime(2026, 11, 1, tzinfo=UTC)


def records(n: int) -> list[UsageRecord]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        created = END - timedelta(seconds=rng.uniform(0, 30 * 86400))
        out.append(
            UsageRecord(
                request_id=f"r{i}",
                tenant_id=f"ten_{rng.randrange(20):02d}",
                tier="rt",
                model="m",
                endpoint="chat",
                prompt_tokens=rng.randint(1, 2000),
                completion_tokens=rng.randint(1, 500),
                ttft_ms=rng.lognormvariate(5, 1),
                tpot_ms=rng.uniform(5, 100),
                status="ok",
                http_status=200,
                slo_met=rng.random() < 0.9,
                created_at=created,
                finished_at=created,
            )
        )
    return out


async def measure(url: str, rows: list[UsageRecord]) -> None:
    await upgrade_async(url)
    engine = create_engine(url)
    store = Store(session_factory(engine))
    for i in range(0, len(rows), 5000):
        await store.insert_usage(rows[i : i + 5000])
    for label, bucket_s in (("30 days by day", 86400), ("30 days by hour", 3600)):
        start = time.perf_counter()
        out = await usage_report(engine, END - timedelta(days=30), END, bucket_s)
        print(f"  {label}: {len(out)} rows in {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    out = await usage_report(engine, END - timedelta(days=30), END, 86400, "ten_03")
    print(f"  one tenant, 30 days by day: {len(out)} rows in {time.perf_counter() - start:.2f} s")
    await engine.dispose()


async def main(n: int) -> None:
    rows = records(n)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"SQLite, {n} records:")
        await measure(f"sqlite:///{tmp}/bench.db", rows)
    name = f"tandem_bench_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(host="127.0.0.1", user="postgres", database="test")
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        print(f"PostgreSQL, {n} records:")
        await measure(f"postgresql://postgres@127.0.0.1:5432/{name}", rows)
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()


asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000))
