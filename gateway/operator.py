"""What an operator of a shared service needs beside the API: quotas, Prometheus metrics, the
dashboard and the OpenAPI document, wired into the app by `install`."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

from aiohttp import web

from gateway import metrics
from gateway.api.openapi import routes as openapi_routes
from gateway.dashboard import routes as dashboard_routes
from gateway.engine.sampler import EngineSampler, SampledEngine, gauge
from gateway.quotas.limiter import QuotaLimiter
from gateway.quotas.sync import QuotaSync
from gateway.state import ADMIN_TOKEN, CONFIG, DB_ENGINE, METRICS, POOL, QUOTAS, USAGE

_TENANT_INFO_TIMEOUT_S = 2.0


def install(app: web.Application) -> None:
    """Adds the quota limiter, the metrics registry and their background tasks, and the routes
    /metrics, /admin/v1/dashboard… and /openapi.json. Call after the database's cleanup context
    is registered (the tasks here use it)."""
    app[QUOTAS] = QuotaLimiter(instance_id=f"gw_{secrets.token_hex(6)}")
    scrape_token = app[CONFIG].metrics.scrape_token
    app[METRICS] = metrics.GatewayMetrics(
        scrape_tokens=(scrape_token, app[ADMIN_TOKEN]) if scrape_token else ()
    )
    app.cleanup_ctx.append(_quota_sync)
    app.cleanup_ctx.append(_engine_sampler)
    app.add_routes(metrics.routes)
    app.add_routes(dashboard_routes)
    app.add_routes(openapi_routes)


async def _quota_sync(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG].quota
    sync = QuotaSync(
        app[DB_ENGINE],
        app[QUOTAS],
        interval_s=config.sync_interval_s,
        timeout_s=config.instance_timeout_s,
    )
    app[METRICS].extra.append(
        lambda: iter(
            [
                gauge(
                    "tandem_gateway_instances",
                    "Gateway processes sharing the quotas (as of the last quota sync).",
                    app[QUOTAS].instances,
                ),
                gauge(
                    "tandem_quota_sync_failures",
                    "Quota syncs with the database that failed since start.",
                    sync.failures,
                ),
            ]
        )
    )
    await sync.start()
    yield
    await sync.close()


async def _engine_sampler(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    registry = app[METRICS]
    engines = [SampledEngine(r.name, r.url, r.dp_rank) for r in app[POOL].replicas]

    def be_in_flight() -> int:
        return int(
            sum(
                sample.value
                for metric in registry.in_flight.collect()
                for sample in metric.samples
                if sample.labels.get("tier") == "be"
            )
        )

    sampler = EngineSampler(
        engines,
        app[DB_ENGINE],
        config.metrics.engine_poll_s,
        config.metrics.history_s,
        be_in_flight,
        headers=config.engine.auth_headers,
    )
    registry.sampler = sampler
    tenants: list[tuple[str, str, str]] = []
    registry.extra.append(
        metrics.tenant_info_collector(lambda: tenants, with_names=config.metrics.tenant_names)
    )
    registry.extra.append(
        lambda: iter(
            [
                gauge(
                    "tandem_usage_records_pending",
                    "Usage records waiting to be written.",
                    app[USAGE].pending,
                )
            ]
        )
    )

    async def refresh_tenants() -> None:
        with contextlib.suppress(Exception):  # database down: keep the last list
            tenants[:] = await asyncio.wait_for(
                metrics.read_tenants(app[DB_ENGINE]), _TENANT_INFO_TIMEOUT_S
            )

    registry.before_scrape.append(refresh_tenants)
    await sampler.start()
    yield
    await sampler.close()
