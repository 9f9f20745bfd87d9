"""GET /admin/v1/usage and `tandem admin usage` against usage_records inserted into SQLite and
PostgreSQL: every figure agrees with the same numbers computed in Python from the records."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from gateway.state import STORE
from gateway.store.types import UsageRecord
from tandem.cli import main as tandem
from tests.functional.gateway_fixtures import ADMIN_TOKEN, GatewayHandle

DAY = datetime(2026, 10, 5, tzinfo=UTC)
STATUSES = ["ok"] * 8 + [
    "engine_error",
    "rate_limited",
    "slo_unattainable",
    "client_disconnected",  # a cancel: not an error, not judged
    "interrupted",  # batch work a shutdown cut off: in no figure
]
UNJUDGED = ("client_disconnected", "interrupted")
ENGINES = ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
RAN_AS_RT = ("admitted", "unchecked", "accepted")


def make_records(tenants: list[str], seed: int = 7) -> list[UsageRecord]:
    """~300 records finished over three hours of DAY (10:00-12:59), a quarter of them batch
    lines that waited up to 55 min between their dispatch and their finish (so many finish in
    a later hour than they were created in), and two that finish the next day."""
    rng = random.Random(seed)
    records = []
    for i in range(300):
        created = DAY + timedelta(hours=10, seconds=rng.uniform(0, 2 * 3600 - 1))
        batch = rng.random() < 0.25
        finished = created + timedelta(seconds=rng.uniform(0, 3300 if batch else 5))
        status = rng.choice(STATUSES)
        ok = status == "ok"
        tier = rng.choice(["rt", "be"])
        refused = status in ("rate_limited", "slo_unattainable")
        admission = rng.choice([*RAN_AS_RT, "downgraded", None])
        if status == "slo_unattainable":
            admission = "shed"
        elif status == "rate_limited":
            admission = None  # refused by the quota: the SLO admission never saw it
        elif admission == "downgraded":
            tier = "be"
        records.append(
            UsageRecord(
                request_id=f"r{i}",
                tenant_id=rng.choice(tenants),
                tier=tier,
                model="tandem-tiny",
                endpoint="batch/chat" if batch else "chat",
                prompt_tokens=rng.randint(1, 500),
                completion_tokens=rng.randint(1, 300) if ok else 0,
                ttft_ms=round(rng.lognormvariate(4, 1), 3) if ok else None,
                tpot_ms=round(rng.uniform(5, 80), 3) if ok and rng.random() < 0.9 else None,
                status=status,
                http_status=200 if ok else 429 if refused else 400,
                slo_met=None if refused or status in UNJUDGED else (ok and rng.random() < 0.8),
                admission=admission,
                engine=None if refused else ENGINES[i % 2],  # refused: never placed
                created_at=created,
                finished_at=finished,
            )
        )
    records.append(
        UsageRecord(
            request_id="next-day",
            tenant_id=tenants[0],
            tier="rt",
            model="tandem-tiny",
            endpoint="chat",
            prompt_tokens=5,
            completion_tokens=5,
            status="ok",
            http_status=200,
            created_at=DAY + timedelta(days=1, hours=1),
            finished_at=DAY + timedelta(days=1, hours=1),
        )
    )
    records.append(
        UsageRecord(
            request_id="over-midnight",
            tenant_id=tenants[0],
            tier="be",
            model="tandem-tiny",
            endpoint="batch/chat",
            prompt_tokens=7,
            completion_tokens=7,
            status="ok",
            http_status=200,
            created_at=DAY + timedelta(hours=23, minutes=50),
            finished_at=DAY + timedelta(days=1, minutes=10),  # counted the day it finished
        )
    )
    return records


def nearest_rank(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p, method="inverted_cdf")) if values else None


def expected(
    records: list[UsageRecord], names: dict[str, str], bucket_s: int, start: datetime, end: datetime
) -> list[dict[str, Any]]:
    groups: dict[tuple[int, str], list[UsageRecord]] = defaultdict(list)
    for r in records:
        if start <= r.finished_at < end and r.status != "interrupted":
            t = int(r.finished_at.timestamp()) // bucket_s * bucket_s
            groups[(t, r.tenant_id)].append(r)
    rows = []
    for (t, tenant), rs in sorted(groups.items()):
        ttft = [r.ttft_ms for r in rs if r.ttft_ms is not None]
        tpot = [r.tpot_ms for r in rs if r.tpot_ms is not None]
        judged = [r for r in rs if r.slo_met is not None]
        met = sum(1 for r in judged if r.slo_met)
        prompt = sum(r.prompt_tokens for r in rs)
        completion = sum(r.completion_tokens for r in rs)
        rows.append(
            {
                "period_start": datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z"),
                "tenant_id": tenant,
                "tenant_name": names[tenant],
                "requests": len(rs),
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "errors": sum(1 for r in rs if r.status not in ("ok", "client_disconnected")),
                "rate_limited": sum(1 for r in rs if r.status == "rate_limited"),
                "cancelled": sum(1 for r in rs if r.status == "client_disconnected"),
                "ttft_ms_p50": nearest_rank(ttft, 50),
                "ttft_ms_p99": nearest_rank(ttft, 99),
                "tpot_ms_p50": nearest_rank(tpot, 50),
                "tpot_ms_p99": nearest_rank(tpot, 99),
                "slo_met": met,
                "slo_judged": len(judged),
                "slo_attainment": met / len(judged) if judged else None,
                "shed": sum(1 for r in rs if r.admission == "shed"),
                "downgraded": sum(1 for r in rs if r.admission == "downgraded"),
                "admitted_met": sum(1 for r in rs if r.admission in RAN_AS_RT and r.slo_met),
                "admitted_missed": sum(
                    1 for r in rs if r.admission in RAN_AS_RT and r.slo_met is False
                ),
            }
        )
    return rows


async def seeded(gw: GatewayHandle) -> tuple[list[UsageRecord], dict[str, str]]:
    names = {}
    for name in ("alpha", "beta"):
        tenant_id, _ = await gw.new_tenant(name, "be")
        names[tenant_id] = name
    records = make_records(sorted(names))
    await gw.app[STORE].insert_usage(records)
    return records, names


async def get(gw: GatewayHandle, query: str) -> tuple[int, str, str]:
    async with gw.session.get(
        f"{gw.base_url}/admin/v1/usage?{query}", headers=gw.admin_headers
    ) as resp:
        return resp.status, resp.content_type, await resp.text()


def normalize(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}


@pytest.mark.parametrize("group_by", ["hour", "day"])
async def test_usage_json_and_csv_agree_with_the_records(
    gateway_without_engine: GatewayHandle, group_by: str
) -> None:
    gw = gateway_without_engine
    records, names = await seeded(gw)
    start, end = DAY, DAY + timedelta(days=1)
    want = expected(records, names, 3600 if group_by == "hour" else 86400, start, end)
    assert len(want) == (6 if group_by == "hour" else 2)
    query = f"start=2026-10-05&end=2026-10-06T00:00:00Z&group_by={group_by}"
    status, content_type, text = await get(gw, query)
    assert status == 200 and content_type == "application/json"
    body = json.loads(text)
    assert body["group_by"] == group_by
    assert [normalize(r) for r in body["data"]] == [normalize(r) for r in want]

    status, content_type, text = await get(gw, query + "&format=csv")
    assert status == 200 and content_type == "text/csv"
    table = list(csv.DictReader(io.StringIO(text)))
    assert len(table) == len(want)
    for line, row in zip(table, want, strict=True):
        for column, value in row.items():
            cell = line[column]
            if value is None:
                assert cell == ""
            elif isinstance(value, float):
                assert float(cell) == pytest.approx(value)
            else:
                assert cell == str(value)


async def test_usage_of_one_tenant_by_id_or_name(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    records, names = await seeded(gw)
    beta = next(t for t, n in names.items() if n == "beta")
    want = expected(
        [r for r in records if r.tenant_id == beta], names, 86400, DAY, DAY + timedelta(days=2)
    )
    for ident in (beta, "beta"):
        status, _, text = await get(gw, f"tenant={ident}&start=2026-10-05&end=2026-10-07")
        assert status == 200
        assert [normalize(r) for r in json.loads(text)["data"]] == [normalize(r) for r in want]


async def test_usage_of_one_engine(gateway_without_engine: GatewayHandle) -> None:
    """One replica's figures: only the requests it ran (refused ones ran on none)."""
    gw = gateway_without_engine
    records, names = await seeded(gw)
    for engine in ENGINES:
        want = expected(
            [r for r in records if r.engine == engine], names, 3600, DAY, DAY + timedelta(days=2)
        )
        query = f"engine={engine}&group_by=hour&start=2026-10-05&end=2026-10-07"
        status, _, text = await get(gw, query)
        assert status == 200
        got = json.loads(text)["data"]
        assert [normalize(r) for r in got] == [normalize(r) for r in want]
        assert sum(r["rate_limited"] for r in got) == 0 and sum(r["requests"] for r in got) > 50


@pytest.mark.parametrize(
    ("query", "status", "param"),
    [
        ("group_by=week", 400, "group_by"),
        ("format=xml", 400, "format"),
        ("start=yesterday", 400, "start"),
        ("start=2026-10-06&end=2026-10-05", 400, "start"),
        ("start=2000-01-01&end=2026-01-01&group_by=hour", 400, "start"),
        ("tenant=nobody", 404, "tenant"),
    ],
)
async def test_bad_usage_queries_name_the_parameter(
    gateway_without_engine: GatewayHandle, query: str, status: int, param: str
) -> None:
    code, _, text = await get(gateway_without_engine, query)
    assert code == status and json.loads(text)["error"]["param"] == param


async def test_usage_needs_the_admin_token(gateway_without_engine: GatewayHandle) -> None:
    gw = gateway_without_engine
    async with gw.session.get(f"{gw.base_url}/admin/v1/usage") as resp:
        assert resp.status == 401


async def test_cli_prints_the_report_as_a_table(
    gateway_without_engine: GatewayHandle,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gw = gateway_without_engine
    records, names = await seeded(gw)
    monkeypatch.setenv("TANDEM_URL", gw.base_url)  # the CLI talks to the gateway's admin API
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", ADMIN_TOKEN)
    code = await asyncio.to_thread(
        tandem,
        ["admin", "usage", "--group-by", "hour", "--start", "2026-10-05", "--end", "2026-10-06"],
    )
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["period", "tenant", "requests"]
    want = expected(records, names, 3600, DAY, DAY + timedelta(days=1))
    assert len(lines) == 1 + len(want)
    for line, row in zip(lines[1:], want, strict=True):
        cells = line.split()
        assert cells[2] == row["tenant_name"] and int(cells[3]) == row["requests"]
        assert int(cells[4]) == row["prompt_tokens"] and int(cells[6]) == row["errors"]
        assert cells[-5] == (
            "-" if row["slo_attainment"] is None else f"{100 * row['slo_attainment']:.1f}%"
        )
        admission = [row[k] for k in ("shed", "downgraded", "admitted_met", "admitted_missed")]
        assert [int(c) for c in cells[-4:]] == admission
    code = await asyncio.to_thread(tandem, ["admin", "usage", "--tenant", "nobody"])
    assert code == 2 and "tenant 'nobody' not found" in capsys.readouterr().err
