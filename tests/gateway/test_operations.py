"""What an operator watches: /healthz, /readyz, /metrics (Prometheus text), /openapi.json. The
fast equivalent of tests/functional/test_metrics_endpoint.py and of the health checks of
tests/functional/test_admin_api.py."""

from __future__ import annotations

import json

from tests.gateway.harness import Gateway, Samples, metric
from tests.gateway.test_batches import chat_line, create_batch, jsonl, upload, wait_for
from tests.waiting import wait_until


async def test_liveness_needs_no_auth(gw: Gateway) -> None:
    for path in ("/healthz", "/health"):
        reply = await gw.request("GET", path)
        assert reply.status == 200 and reply.body == {"status": "ok"}


async def test_ready_when_engine_and_database_are(gw: Gateway) -> None:
    reply = await gw.request("GET", "/readyz")
    assert reply.status == 200, reply
    assert reply.body == {"status": "ready", "checks": {"engine": "ok", "database": "ok"}}


async def test_not_ready_while_the_engine_is_down(gw_engine_down: Gateway) -> None:
    for path in ("/healthz", "/health"):
        assert (await gw_engine_down.request("GET", path)).status == 200  # alive all the same
    reply = await gw_engine_down.request("GET", "/readyz")
    assert reply.status == 503 and reply.body["status"] == "not_ready"
    assert reply.body["checks"] == {"engine": "unavailable", "database": "ok"}


async def test_unknown_paths_and_methods_get_error_bodies(gw: Gateway) -> None:
    reply = await gw.request("GET", "/v1/nothing-here")
    assert reply.status == 404 and reply.error["message"]
    reply = await gw.request("GET", "/v1/chat/completions")
    assert reply.status == 405 and reply.error["message"]


async def test_openapi_document_is_served(gw: Gateway) -> None:
    reply = await gw.request("GET", "/openapi.json")
    assert reply.status == 200, reply
    paths = reply.body["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/batches"):
        assert path in paths
    json.dumps(reply.body)  # plain JSON all the way down


async def test_metrics_count_requests_tokens_latency_slo_quota_engine_and_batches(
    gw: Gateway,
) -> None:
    tenant_id, key = await gw.new_tenant("metrics", quota={"requests_per_min": 2})
    for _ in range(2):
        reply = await gw.chat(key, max_tokens=8)
        assert reply.status == 200, reply
    assert (await gw.chat(key, max_tokens=8)).status == 429
    _, be_key = await gw.new_tenant("metrics-batch", "be")
    file = await upload(gw, be_key, jsonl([chat_line(f"m{i}", "hi") for i in range(3)]))
    batch = (await create_batch(gw, be_key, file.body["id"])).body
    assert (await wait_for(gw, be_key, batch["id"]))["status"] == "completed"

    async def scraped() -> Samples | None:
        # the engine and batch gauges come from a sampler polling in the background (and a
        # scrape during a sample may see the batch counts new and the backlog not yet)
        m = await gw.metrics()
        sampled = metric(m, "tandem_batches", status="completed") == 1
        settled = metric(m, "tandem_be_backlog_requests") == 0
        return m if sampled and settled and metric(m, "tandem_engine_up") == 1 else None

    m = await wait_until(scraped, what="the engine and batch gauges sampled")
    t = {"tenant": tenant_id, "tier": "rt"}
    assert metric(m, "tandem_requests_total", **t, status="ok") == 2
    assert metric(m, "tandem_requests_total", **t, status="rate_limited") == 1
    assert (
        metric(m, "tandem_quota_rejections_total", tenant=tenant_id, limit="requests_per_min") == 1
    )
    assert metric(m, "tandem_tokens_total", **t, kind="completion") == 16
    assert (metric(m, "tandem_tokens_total", **t, kind="prompt") or 0) > 0
    assert metric(m, "tandem_ttft_seconds_count", **t) == 2
    assert metric(m, "tandem_tpot_seconds_count", **t) == 2
    assert metric(m, "tandem_request_duration_seconds_count", **t) == 2
    assert metric(m, "tandem_ttft_seconds_bucket", **t, le="+Inf") == 2
    assert metric(m, "tandem_slo_requests_total", **t, result="met") == 2  # generous targets
    assert metric(m, "tandem_slo_attainment_ratio", **t) == 1.0
    assert metric(m, "tandem_requests_in_flight", **t) == 0
    assert metric(m, "tandem_tenant_info", tenant=tenant_id, tier="rt") == 1  # no name: ids only
    kv = metric(m, "tandem_engine_kv_usage_ratio")
    assert kv is not None and 0.0 <= kv <= 1.0
    assert (metric(m, "tandem_engine_kv_capacity_tokens") or 0) > 0
    assert metric(m, "tandem_engine_waiting_requests") is not None
    assert metric(m, "tandem_engine_running_requests") is not None
    assert metric(m, "tandem_be_backlog_requests") == 0
    assert metric(m, "tandem_usage_records_pending") is not None
    assert metric(m, "tandem_gateway_instances") == 1
    assert metric(m, "tandem_quota_sync_failures") == 0


async def test_metrics_say_the_engine_is_down(gw_engine_down: Gateway) -> None:
    async def sampled() -> Samples | None:
        m = await gw_engine_down.metrics()
        return m if metric(m, "tandem_engine_up") is not None else None

    m = await wait_until(sampled, what="the engine sampled")
    assert metric(m, "tandem_engine_up") == 0


async def test_dashboard_needs_the_admin_token(gw: Gateway) -> None:
    assert (await gw.request("GET", "/admin/v1/dashboard")).status == 401
    reply = await gw.request("GET", "/admin/v1/dashboard/data", admin=True)
    assert reply.status == 200 and isinstance(reply.body, dict)
