"""Small factories for the request pipeline's unit tests: tenants, engine requests, a scripted
engine and an app holding just what the stages read (no network, no database)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from common.config import Config
from gateway.api.schemas import ChatCompletionRequest
from gateway.auth import Principal
from gateway.engine.client import EngineChunk
from gateway.metrics import GatewayMetrics
from gateway.pipeline.prepare import EngineRequest, PreparedPrompt, build_engine_request
from gateway.pipeline.stages import Flight
from gateway.quotas.limiter import QuotaLimiter
from gateway.state import BACKGROUND, CONFIG, ENGINE, METRICS, QUOTAS, USAGE
from gateway.store.types import Quota, Slo, Tenant, UsageRecord

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def make_tenant(tier: str = "rt", quota: Quota | None = None, **slo: Any) -> Tenant:
    if tier == "rt" and not slo:
        slo = {"ttft_target_ms": 5000, "tpot_target_ms": 1000}
    return Tenant(
        id=f"ten_{tier}",
        name=tier,
        tier=tier,  # type: ignore[arg-type]
        slo=Slo(**slo),
        quota=quota or Quota(),
        created_at=NOW,
        updated_at=NOW,
    )


def make_principal(tenant: Tenant | None = None) -> Principal:
    return Principal(tenant=tenant or make_tenant(), key_id="key_1", key_prefix="p")


def chat_body(**fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return msgspec.convert({"model": "m", "messages": messages, **fields}, ChatCompletionRequest)


def make_request(
    principal: Principal, prompt_len: int = 4, max_tokens: int = 8, tier: str = "rt"
) -> EngineRequest:
    ids = list(range(1, prompt_len + 1))
    return build_engine_request(chat_body(), ids, max_tokens, principal, tier)  # type: ignore[arg-type]


def make_prompt(prompt_len: int = 4, max_tokens: int = 8) -> PreparedPrompt:
    return PreparedPrompt(input_ids=list(range(1, prompt_len + 1)), max_tokens=max_tokens)


def chunk(text: str, tokens: int, finish: str | None = None) -> EngineChunk:
    return EngineChunk(
        text_delta=text,
        completion_tokens=tokens,
        prompt_tokens=4,
        finish_reason=finish,
        queue_time_s=0.002,
    )


Script = Callable[[], AsyncGenerator[EngineChunk, None]]


def replies(*chunks: EngineChunk) -> Script:
    """An engine that streams *chunks* and ends."""

    async def script() -> AsyncGenerator[EngineChunk, None]:
        for c in chunks:
            yield c

    return script


def fails_with(exc: Exception, *before: EngineChunk) -> Script:
    """An engine that streams *before*, then raises *exc* (EngineUnavailable, …)."""

    async def script() -> AsyncGenerator[EngineChunk, None]:
        for c in before:
            yield c
        raise exc

    return script


def hangs_after(*before: EngineChunk) -> Script:
    """An engine that streams *before*, then generates forever (nothing more arrives)."""

    async def script() -> AsyncGenerator[EngineChunk, None]:
        for c in before:
            yield c
        await asyncio.Event().wait()
        yield c  # pragma: no cover

    return script


class FakeEngine:
    """An engine client that plays a script and remembers what it was asked."""

    base_url = "http://engine.test"

    def __init__(self, script: Script) -> None:
        self.script = script
        self.payloads: list[dict[str, Any]] = []
        self.streamed: list[bool] = []
        self.aborted: list[str] = []

    async def generate(
        self, payload: dict[str, Any], *, stream: bool = True
    ) -> AsyncGenerator[EngineChunk, None]:
        self.payloads.append(payload)
        self.streamed.append(stream)
        async for c in self.script():
            yield c

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


class FakeUsage:
    """The usage recorder's `record`, keeping what it was given."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []
        self.length_keys: list[str | None] = []

    def record(
        self, record: UsageRecord, *, length_key: str | None = None, key_id: str | None = None
    ) -> None:
        self.records.append(record)
        self.length_keys.append(length_key)


def make_app(engine: FakeEngine, limiter: QuotaLimiter | None = None) -> web.Application:
    app = web.Application()
    app[CONFIG] = Config()
    app[ENGINE] = engine  # type: ignore[assignment]
    app[QUOTAS] = limiter or QuotaLimiter("gw_test")
    app[METRICS] = GatewayMetrics()
    app[USAGE] = FakeUsage()  # type: ignore[assignment]
    app[BACKGROUND] = set()
    return app


def usage_of(app: web.Application) -> FakeUsage:
    usage = app[USAGE]
    assert isinstance(usage, FakeUsage)
    return usage


def make_flight(principal: Principal, origin: str = "api") -> Flight:
    return Flight(principal=principal, origin=origin, endpoint="chat", model="m")  # type: ignore[arg-type]
