"""Typed application state (aiohttp `AppKey`s), filled by the app factory's cleanup contexts."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine

from backend.policy.feasibility import SloForecaster, TtftFeedbackByEngine
from backend.policy.placement import Router
from common.config import Config
from gateway.auth import AuthCache
from gateway.engine.client import EngineClient
from gateway.engine.load import LoadWatcher
from gateway.engine.pool import EnginePool
from gateway.engine.stats import EngineStatsWindow
from gateway.metrics import METRICS_KEY
from gateway.pipeline.admission_log import RefusalLog
from gateway.pipeline.slot_line import SlotLine
from gateway.pipeline.tier_queue import TierQueues
from gateway.quotas.limiter import QuotaLimiter
from gateway.shutdown import Drain
from gateway.store.repo import Store
from gateway.tokenizer import ModelTokenizer
from gateway.usage import UsageRecorder

CONFIG = web.AppKey("config", Config)
ADMIN_TOKEN = web.AppKey("admin_token", str)
TOKENIZER = web.AppKey("tokenizer", ModelTokenizer)
DB_ENGINE = web.AppKey("db_engine", AsyncEngine)
STORE = web.AppKey("store", Store)
AUTH = web.AppKey("auth", AuthCache)
ENGINE = web.AppKey("engine", EngineClient)
"""The client of the pool's first engine (`POOL` has every engine's)."""
POOL = web.AppKey("engine_pool", EnginePool)
"""The engines behind the gateway, each with its client, health and statistics
(`gateway.engine.pool`): placement, /readyz and /metrics read it; `tandem serve` hands each
launched engine's health to its supervisor before the app starts."""
USAGE = web.AppKey("usage", UsageRecorder)
QUOTAS = web.AppKey("quotas", QuotaLimiter)
METRICS = METRICS_KEY
LOADS: web.AppKey[dict[str, LoadWatcher]] = web.AppKey("engine_loads")
"""Each engine's live state (`gateway.engine.load`), by `EngineHandle.name`; no entry for an
engine that does not report it (stock SGLang)."""
ENGINE_STATS = web.AppKey("engine_stats", EngineStatsWindow)
"""The first engine's last two `/stats` readings (set when tandem's policy is in charge; each
engine's are its `EngineReplica.stats`)."""
SLO_FORECASTER = web.AppKey("slo_forecaster", SloForecaster)
"""The SLO admission's forecaster, on the latency model the engine's policy plans with."""
ROUTER: web.AppKey[Router] = web.AppKey("router")
"""The place stage's router (`gateway.router`) and its memory of what it placed where."""
TTFT_FEEDBACK = web.AppKey("ttft_feedback", TtftFeedbackByEngine)
"""What admitted RT requests' real TTFT taught the SLO admission about each engine's forecast."""
REFUSAL_LOG = web.AppKey("refusal_log", RefusalLog)
"""The SLO admission's refusals, logged at most once a second per engine."""
SLOT_LINE = web.AppKey("slot_line", SlotLine)
"""The RT requests kept at the gateway for a request slot, per engine, in arrival order; absent
when the engine's policy turns the line off (`TandemConfig.slo_slot_line`)."""
TIER_QUEUES = web.AppKey("tier_queues", TierQueues)
"""Interactive requests in flight per tier, against the tiers' bounds (the pool's: each
engine's bound times the engines)."""
DRAIN = web.AppKey("drain", Drain)
"""The requests inside the gateway, and the drain that ends them when it stops
(`gateway.shutdown`)."""
BACKGROUND: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("background_tasks")
"""Fire-and-forget tasks (engine aborts after a disconnect) kept referenced until done."""


def spawn(app: web.Application, coro: Coroutine[Any, Any, None]) -> None:
    """Runs *coro* in the background, holding a reference so it is not garbage-collected."""
    task = asyncio.create_task(coro)
    tasks = app[BACKGROUND]
    tasks.add(task)
    task.add_done_callback(tasks.discard)
