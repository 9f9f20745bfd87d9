"""GET /metrics on the gateway in front of the real engine: request, token, latency and SLO series
by tenant and tier, quota refusals, the engine's queues and KV use, BE backlog and batch
progress, all in the Prometheus text format a scraper parses."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Table, insert

from gateway.state import DB_ENGINE, METRICS
from gateway.store.models import BatchItemRow, BatchRow, FileRow
from tests.functional.gateway_fixtures import GatewayHandle
from tests.functional.test_quotas import chat, tenant_with_quota
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(gw: GatewayHandle) -> Samples:
    async with gw.session.get(f"{gw.base_url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, metric: str, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


def forecast_errors(samples: Samples) -> float:
    """First tokens measured against their SLO forecast, on every engine."""
    name = "tandem_slo_ttft_forecast_error_seconds_count"
    return sum(v for (metric, _), v in samples.items() if metric == name)


def _filler(table: Table, given: dict[str, Any]) -> dict[str, Any]:
    """*given* plus a plain value for every other NOT NULL column (robust to new columns)."""
    row = dict(given)
    now = datetime.now(UTC)
    for column in table.columns:
        if column.name in row or column.nullable or column.autoincrement is True:
            continue
        try:
            kind: type = column.type.python_type
        except NotImplementedError:  # a type decorator: the type it stores
            kind = getattr(column.type, "impl", column.type).python_type
        row[column.name] = {datetime: now, int: 0, float: 0.0, bool: False, bytes: b""}.get(
            kind, "x"
        )
    return row


async def seed_batch(gw: GatewayHandle, tenant_id: str) -> str:
    """A running batch with 4 lines, 1 of them finished."""
    files, batches = cast(Table, FileRow.__table__), cast(Table, BatchRow.__table__)
    items = cast(Table, BatchItemRow.__table__)
    async with gw.app[DB_ENGINE].begin() as conn:
        await conn.execute(
            insert(files).values(
                _filler(files, {"id": "file-metrics", "tenant_id": tenant_id, "purpose": "batch"})
            )
        )
        await conn.execute(
            insert(batches).values(
                _filler(
                    batches,
                    {
                        "id": "batch_metrics",
                        "tenant_id": tenant_id,
                        "input_file_id": "file-metrics",
                        "status": "in_progress",
                    },
                )
            )
        )
        for i, status in enumerate(["completed", "pending", "pending", "running"]):
            await conn.execute(
                insert(items).values(
                    _filler(
                        items,
                        {
                            "batch_id": "batch_metrics",
                            "line_no": i,
                            "custom_id": f"c{i}",
                            "status": status,
                        },
                    )
                )
            )
    return "batch_metrics"


async def test_metrics_expose_requests_latency_slo_engine_and_batches(
    gateway: GatewayHandle,
) -> None:
    tenant_id, key = await tenant_with_quota(gateway, "metrics-tenant", requests_per_min=2)
    errors_before = forecast_errors(await scrape(gateway))  # the gateway serves other tests too
    for _ in range(2):
        status, _, body = await chat(gateway, key, max_tokens=8)
        assert status == 200, body
    status, _, _ = await chat(gateway, key)
    assert status == 429
    batch_id = await seed_batch(gateway, tenant_id)
    await gateway.app[METRICS].sampler.sample()  # type: ignore[union-attr]

    m = await scrape(gateway)
    t = {"tenant": tenant_id, "tier": "rt"}
    assert value(m, "tandem_requests_total", **t, status="ok") == 2
    assert value(m, "tandem_requests_total", **t, status="rate_limited") == 1
    assert (
        value(m, "tandem_quota_rejections_total", tenant=tenant_id, limit="requests_per_min") == 1
    )
    assert value(m, "tandem_tokens_total", **t, kind="completion") == 16
    assert value(m, "tandem_tokens_total", **t, kind="prompt") > 0  # type: ignore[operator]
    assert value(m, "tandem_ttft_seconds_count", **t) == 2
    assert value(m, "tandem_tpot_seconds_count", **t) == 2
    assert value(m, "tandem_request_duration_seconds_count", **t) == 2
    assert value(m, "tandem_ttft_seconds_bucket", **t, le="+Inf") == 2
    assert value(m, "tandem_slo_requests_total", **t, result="met") == 2  # generous targets
    assert value(m, "tandem_slo_attainment_ratio", **t) == 1.0
    # each chat admitted on a forecast (all but a first one the engine had not reported before)
    # adds how far its first token came from it, on its engine
    admitted = value(
        m, "tandem_slo_admissions_total", tenant=tenant_id, outcome="admitted", target=""
    )
    assert admitted in (1, 2)
    assert forecast_errors(m) - errors_before == admitted
    assert value(m, "tandem_requests_in_flight", **t) == 0
    assert value(m, "tandem_tenant_info", tenant=tenant_id, tier="rt") == 1  # ids, not names
    assert value(m, "tandem_engine_up") == 1
    kv = value(m, "tandem_engine_kv_usage_ratio")
    assert kv is not None and 0.0 <= kv <= 1.0
    assert value(m, "tandem_engine_kv_capacity_tokens") > 0  # type: ignore[operator]
    assert value(m, "tandem_engine_waiting_requests") is not None
    assert value(m, "tandem_engine_running_requests") is not None
    # two lines waiting to be sent; the seeded "running" one is in flight nowhere (a running
    # line counts as the BE request in flight it is, once)
    assert value(m, "tandem_be_backlog_requests") == 2
    assert value(m, "tandem_batches", status="in_progress") == 1
    assert value(m, "tandem_batch_lines", status="pending") == 2
    assert value(m, "tandem_batch_progress_ratio", batch=batch_id) == 0.25
    assert value(m, "tandem_usage_records_pending") is not None
    assert value(m, "tandem_gateway_instances") == 1
    assert value(m, "tandem_quota_sync_failures") == 0


async def test_the_latency_profiles_error_on_the_real_engine_is_a_gauge(
    gateway: GatewayHandle,
) -> None:
    """The engine runs the tandem policy with the cpu-tiny profile: /metrics tells an operator how
    far that profile is from the engine's real iteration times, and the calibration's pace."""
    _, key = await tenant_with_quota(gateway, "latency-gauges")
    for _ in range(2):
        status, _, body = await chat(gateway, key, max_tokens=16)
        assert status == 200, body

    async def error_gauges() -> Samples | None:
        samples = await scrape(gateway)
        found = value(samples, "tandem_engine_latency_model_error", quantile="0.5")
        return samples if found is not None else None

    samples = await wait_until(
        error_gauges, timeout_s=30, what="the latency-model error gauge on /metrics"
    )
    p50 = value(samples, "tandem_engine_latency_model_error", quantile="0.5")
    p99 = value(samples, "tandem_engine_latency_model_error", quantile="0.99")
    assert p50 is not None and p99 is not None and 0.0 <= p50 <= p99
    for regime in ("decode", "prefill", "mixed"):
        # the engine's pace against the profile: whatever this host's speed (a busy CI host ran
        # 4× slower than cpu-tiny), a positive factor within the calibration's bounds
        factor = value(samples, "tandem_engine_latency_factor", regime=regime)
        assert factor is not None and 1 / 256 <= factor <= 256, (regime, factor)

    # the chats just ran: once the gateway has read the engine's stats after them, the
    # calibration learned from their iterations seconds ago (engine and gateway share a clock)
    async def fresh_age() -> float | None:
        age_s = value(await scrape(gateway), "tandem_engine_latency_calibration_age_seconds")
        return age_s if age_s is not None and 0.0 <= age_s < 120.0 else None

    await wait_until(fresh_age, timeout_s=30, what="a fresh calibration age on /metrics")
