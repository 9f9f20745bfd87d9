"""The gateway's aiohttp application factory.

Every long-lived resource (database engine, HTTP client to the engine, usage recorder) is
created and closed in a cleanup context, in dependency order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
from aiohttp import web
from prometheus_client.registry import Collector

from backend.policy.feasibility import TtftFeedback
from backend.policy.placement import make_router
from common.config import Config
from gateway.api import admin, batches, files, openai, ops
from gateway.api.body import body_guard
from gateway.auth import AuthCache
from gateway.auth_sync import auth_sync
from gateway.batch.app import batch_context
from gateway.engine.client import EngineClient
from gateway.engine.control import length_sync
from gateway.engine.health import FIRST_PROBE_TIMEOUT_S, EngineHealth
from gateway.engine.load import LoadWatcher, serves_load, watch
from gateway.errors import error_middleware
from gateway.loop_watch import LoopWatch
from gateway.operator import install as install_operator_tools
from gateway.overload import OVERLOAD, OverloadGuard
from gateway.pipeline.admission import build_forecaster
from gateway.pipeline.tier_queue import TierQueues, tier_bounds
from gateway.request_id import add_request_id
from gateway.state import (
    ADMIN_TOKEN,
    AUTH,
    BACKGROUND,
    CONFIG,
    DB_ENGINE,
    ENGINE,
    ENGINE_HEALTH,
    LOADS,
    METRICS,
    ROUTER,
    SLO_FORECASTER,
    STORE,
    TIER_QUEUES,
    TOKENIZER,
    TTFT_FEEDBACK,
    USAGE,
)
from gateway.store.db import create_engine, session_factory
from gateway.store.outage import DATABASE_OUTAGE, outage_of
from gateway.store.readiness import DATABASE_READINESS, start_readiness, stop_readiness
from gateway.store.repo import Store
from gateway.tokenizer import ModelTokenizer
from gateway.usage import UsageRecorder

# engine SSE lines carry the cumulative text of a generation; allow long ones
_ENGINE_READ_BUFSIZE = 4 * 1024 * 1024


def create_app(config: Config, admin_token: str, model_dir: Path) -> web.Application:
    """The gateway for *config*, serving the model in *model_dir* (its tokenizer is loaded now)."""
    guard = OverloadGuard(config.gateway)  # first: a flood is shed before any other work
    app = web.Application(
        middlewares=[guard.middleware, error_middleware, body_guard],
        client_max_size=config.gateway.max_body_bytes,
    )
    app[OVERLOAD] = guard
    app.on_response_prepare.append(add_request_id)  # x-request-id on every response
    app[CONFIG] = config
    app[ADMIN_TOKEN] = admin_token
    app[TOKENIZER] = ModelTokenizer(model_dir)
    app[BACKGROUND] = set()
    app[LOADS] = {}
    app[SLO_FORECASTER] = build_forecaster(config)
    app[ROUTER] = make_router(config.gateway.router, app[SLO_FORECASTER])
    app[TTFT_FEEDBACK] = TtftFeedback()
    app[TIER_QUEUES] = TierQueues(tier_bounds(config.gateway))
    app.cleanup_ctx.append(_loop_watch)
    app.cleanup_ctx.append(_database)
    app.cleanup_ctx.append(auth_sync)  # revocations reach the other processes (PostgreSQL)
    app.cleanup_ctx.append(_engine_client)
    app.cleanup_ctx.append(_engine_health)  # what /readyz answers from
    app.cleanup_ctx.append(_load_watchers)  # the engine's live state, for the SLO admission
    app.cleanup_ctx.append(_usage_recorder)
    app.cleanup_ctx.append(_background_tasks)
    app.cleanup_ctx.append(batch_context)  # closes first: its line aborts reach _background_tasks
    app.cleanup_ctx.append(length_sync)  # engine's length histories ← SQL
    install_operator_tools(app)  # quotas, /metrics, dashboard, /openapi.json
    app[METRICS].registry.register(cast(Collector, guard))
    app.add_routes(ops.routes)
    app.add_routes(openai.routes)
    app.add_routes(admin.routes)
    app.add_routes(files.routes)
    app.add_routes(batches.routes)
    return app


async def _loop_watch(app: web.Application) -> AsyncIterator[None]:
    """The event loop's lag and stalls (gateway/loop_watch.py), for as long as the app runs."""
    gateway = app[CONFIG].gateway
    watch = LoopWatch(
        asyncio.get_running_loop(),
        app[METRICS].registry,
        interval_s=gateway.loop_watch_interval_s,
        stall_s=gateway.loop_stall_ms / 1000.0,
    )
    watch.start()
    yield
    watch.stop()


async def _database(app: web.Application) -> AsyncIterator[None]:
    engine = create_engine(app[CONFIG].database.url, echo=app[CONFIG].database.echo)
    app[DB_ENGINE] = engine
    app[DATABASE_OUTAGE] = outage_of(engine)  # 503s and one log line per outage
    app[STORE] = Store(session_factory(engine))
    app[AUTH] = AuthCache(app[STORE], ttl_s=app[CONFIG].gateway.auth_cache_ttl_s)
    # what /readyz answers from: checked in the background, never on the probe's path
    app[DATABASE_READINESS], readiness_task = await start_readiness(engine, app[DATABASE_OUTAGE])
    yield
    await stop_readiness(readiness_task)
    await engine.dispose()


async def _engine_client(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    session = aiohttp.ClientSession(
        read_bufsize=_ENGINE_READ_BUFSIZE,
        connector=aiohttp.TCPConnector(limit=0),  # one connection per in-flight request
        headers=config.engine.auth_headers,  # the engine refuses requests without its key
    )
    base_url = f"http://{config.engine.host}:{config.engine.port}"
    app[ENGINE] = EngineClient(base_url, session, timeout_s=config.engine.request_timeout_s)
    yield
    await session.close()


async def _engine_health(app: web.Application) -> AsyncIterator[None]:
    """The engine's health: the launcher's supervisor feeds it when it set `ENGINE_HEALTH`;
    else the gateway probes the engine itself (once before serving, then in the background)."""
    if ENGINE_HEALTH in app:
        health, watcher = app[ENGINE_HEALTH], None
    else:
        engine = app[CONFIG].engine
        client = app[ENGINE]
        health = app[ENGINE_HEALTH] = EngineHealth(client.base_url)
        await health.probe(
            client.is_healthy, min(engine.health_probe_timeout_s, FIRST_PROBE_TIMEOUT_S)
        )
        watcher = asyncio.create_task(
            health.watch(
                client.is_healthy, engine.health_probe_interval_s, engine.health_probe_timeout_s
            )
        )
    if METRICS in app:
        app[METRICS].registry.register(cast(Collector, health))
    yield
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _load_watchers(app: web.Application) -> AsyncIterator[None]:
    """One `LoadWatcher` per engine that reports its live state, keyed like `EngineHandle.name`
    (the engine client's base URL), long-polling while the app runs."""
    engine = app[CONFIG].engine
    if not serves_load(engine):
        yield
        return
    watcher = LoadWatcher(app[ENGINE].base_url)
    app[LOADS][watcher.engine_name] = watcher
    if METRICS in app:
        app[METRICS].extra.append(watcher.collect)
    async for _ in watch(watcher, engine):
        yield


async def _usage_recorder(app: web.Application) -> AsyncIterator[None]:
    recorder = UsageRecorder(app[STORE], app[CONFIG].usage, app[DATABASE_OUTAGE])
    app[USAGE] = recorder
    recorder.start()
    yield
    await recorder.close()


async def _background_tasks(app: web.Application) -> AsyncIterator[None]:
    yield
    pending: set[asyncio.Task[None]] = app[BACKGROUND]
    if pending:  # engine aborts of requests whose clients left: let them reach the engine
        await asyncio.wait(list(pending), timeout=10)
