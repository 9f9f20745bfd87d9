"""The gateway's aiohttp application factory.

Every long-lived resource (database engine, HTTP client to the engine, usage recorder) is
created and closed in a cleanup context, in dependency order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import aiohttp
from aiohttp import web
from prometheus_client.registry import Collector

from backend.policy.placement import make_router
from common.config import Config
from gateway.api import admin, batches, files, openai, ops
from gateway.api.body import body_guard
from gateway.auth import AuthCache
from gateway.auth_sync import auth_sync
from gateway.batch.app import BATCH_LEADER, batch_context
from gateway.engine.client import EngineClient
from gateway.engine.control import length_sync
from gateway.engine.load import LoadWatcher, watch
from gateway.engine.pool import SILENCE_S, EnginePool, merged_by_engine
from gateway.errors import error_middleware
from gateway.loop_watch import LoopWatch
from gateway.operator import install as install_operator_tools
from gateway.overload import OVERLOAD, OverloadGuard
from gateway.pipeline.admission import build_forecaster, build_slot_line, build_ttft_feedback
from gateway.pipeline.admission_log import RefusalLog
from gateway.pipeline.tier_queue import TierQueues, tier_bounds
from gateway.request_id import add_request_id
from gateway.shutdown import Drain
from gateway.state import (
    ADMIN_TOKEN,
    AUTH,
    BACKGROUND,
    CONFIG,
    DB_ENGINE,
    DRAIN,
    ENGINE,
    LOADS,
    METRICS,
    POOL,
    REFUSAL_LOG,
    ROUTER,
    SLO_FORECASTER,
    SLOT_LINE,
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

log = logging.getLogger(__name__)

# engine SSE lines carry the cumulative text of a generation; allow long ones
_ENGINE_READ_BUFSIZE = 4 * 1024 * 1024
ENGINE_KEEPALIVE_S = 2.0
"""How long an idle connection to an engine is kept for the next request, seconds: shorter than
the engine keeps it (SGLang's uvicorn: 5 s, `SGLANG_TIMEOUT_KEEP_ALIVE`). Kept longer (aiohttp's
default is 15 s), a request sent on a connection the engine had just closed failed at once with
a 503 "engine lost" (ServerDisconnectedError, ClientOSError): twice in one live W6 run."""


def create_app(config: Config, admin_token: str, model_dir: Path) -> web.Application:
    """The gateway for *config*, serving the model in *model_dir* (its tokenizer is loaded now)."""
    guard = OverloadGuard(config.gateway)  # first: a flood is shed before any other work
    drain = Drain()  # inside the error middleware, which answers its refusals
    app = web.Application(
        middlewares=[guard.middleware, error_middleware, drain.middleware, body_guard],
        client_max_size=config.gateway.max_body_bytes,
    )
    app[OVERLOAD] = guard
    app[DRAIN] = drain
    app.on_shutdown.append(_drain)  # listening has stopped; the handlers are not yet waited for
    app.on_response_prepare.append(add_request_id)  # x-request-id on every response
    app[CONFIG] = config
    app[ADMIN_TOKEN] = admin_token
    app[TOKENIZER] = ModelTokenizer(model_dir)
    app[BACKGROUND] = set()
    app[LOADS] = {}
    app[POOL] = EnginePool(config.engine)
    app[SLO_FORECASTER] = build_forecaster(config)
    app[ROUTER] = make_router(config.gateway.router, app[SLO_FORECASTER])
    app[TTFT_FEEDBACK] = build_ttft_feedback(config)
    app[REFUSAL_LOG] = RefusalLog()
    if (line := build_slot_line(config)) is not None:
        app[SLOT_LINE] = line
    # the bounds are per engine: the pool's queues hold as many as its engines together
    app[TIER_QUEUES] = TierQueues(tier_bounds(config.gateway, engines=len(app[POOL])))
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
    """One HTTP client per engine of the pool, over one session."""
    config = app[CONFIG]
    session = aiohttp.ClientSession(
        read_bufsize=_ENGINE_READ_BUFSIZE,
        # one connection per in-flight request, dropped before the engine drops it
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=ENGINE_KEEPALIVE_S),
        headers=config.engine.auth_headers,  # the engine refuses requests without its key
    )
    pool = app[POOL]
    for replica in pool.replicas:
        replica.client = EngineClient(
            replica.url,
            session,
            timeout_s=config.engine.request_timeout_s,
            dp_rank=replica.dp_rank,
        )
    app[ENGINE] = pool.replicas[0].require_client()  # the first engine (single-engine callers)
    for line in pool.describe_attachments():
        log.info("%s", line)
    yield
    await pool.close()
    await session.close()


async def _drain(app: web.Application) -> None:
    """The requests and batch lines in flight finish, or are ended, before the gateway stops
    (gateway/shutdown.py); no batch line starts meanwhile."""
    leadership = app.get(BATCH_LEADER)
    lines = leadership.stop_starting() if leadership is not None else None
    ended = await app[DRAIN].drain(app[CONFIG].gateway.shutdown_timeout_s, lines)
    if ended:
        log.warning("shutting down: ended %d requests in flight", ended)


async def _engine_health(app: web.Application) -> AsyncIterator[None]:
    """Each engine's health: its supervisor feeds it when `tandem serve` launched it (and
    called `EngineReplica.take_supervision`); else the gateway probes the engine itself (once
    before serving, then in the background)."""
    pool = app[POOL]
    await pool.first_probe()
    watchers = pool.start_watching()
    if METRICS in app:
        app[METRICS].registry.register(cast(Collector, pool))
    yield
    for watcher in watchers:
        watcher.cancel()
    for watcher in watchers:
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _load_watchers(app: web.Application) -> AsyncIterator[None]:
    """One `LoadWatcher` per engine that reports its live state, keyed like `EngineHandle.name`
    (the engine client's base URL), long-polling while the app runs."""
    pool = app[POOL]
    watched = [r for r in pool.replicas if r.reports_load]
    if not watched:
        yield
        return
    async with contextlib.AsyncExitStack() as stack:
        for replica in watched:
            # in a pool, an engine that leaves its live-state poll unanswered is out of
            # placement at once (a hung or frozen replica: gateway/engine/pool.py)
            watcher = LoadWatcher(
                replica.name,
                silence_s=SILENCE_S if len(pool) > 1 else None,
                on_silent=functools.partial(
                    pool.suspect, replica.name, "its live state went silent"
                ),
            )
            app[LOADS][watcher.engine_name] = watcher
            await stack.enter_async_context(
                contextlib.asynccontextmanager(watch)(watcher, replica.engine)
            )
        if METRICS in app:
            app[METRICS].extra.append(
                lambda: merged_by_engine(
                    (name, watcher.collect) for name, watcher in list(app[LOADS].items())
                )
            )
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
