"""The patched engine's live state (real engine on CPU): the control endpoint's ``GET /load`` long
poll answers with a later iteration while requests run, and the gateway's `LoadWatcher`, over the
same control socket, sees a running RT request (its tenant's fair-share counter with it) and then
none; the engine's iteration log (``GET /iterations``) says what each iteration ran."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import msgspec
import pytest

from common.wire import (
    CONTROL_ITERATIONS_PATH,
    CONTROL_LOAD_PATH,
    RecentIterations,
    RequestMeta,
    meta_to_custom_params,
)
from gateway.engine.load import LoadWatcher, watch
from tests.functional.engine_fixtures import EngineServer, control, stream_events
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 96


def _rt_request(engine: EngineServer) -> int:
    """One RT request streamed to the end; its completion tokens."""
    meta = RequestMeta(
        tier="rt",
        tenant_id="load-test",
        length_key="load-test",
        arrival_unix_s=time.time(),
        ttft_target_ms=60_000,
        tpot_target_ms=10_000,
        max_tokens=MAX_NEW_TOKENS,
    )
    body: dict[str, Any] = {
        "text": "Once upon a time, in a land far away,",
        "rid": f"test-load-{uuid.uuid4().hex}",
        "sampling_params": {
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "custom_params": meta_to_custom_params(meta),
        },
    }
    chunks = list(stream_events(engine.base_url, "/generate", body))
    return int(chunks[-1]["meta_info"]["completion_tokens"])


def _load(engine: EngineServer, after: int, wait_s: float) -> dict[str, Any]:
    status, body = control(engine, "GET", f"{CONTROL_LOAD_PATH}?after={after}&wait_s={wait_s}")
    assert status == 200, body
    assert isinstance(body, dict)
    return body


async def test_load_long_poll_and_watcher_follow_a_running_rt_request(
    engine_server: EngineServer,
) -> None:
    first = await asyncio.to_thread(_load, engine_server, -1, 0)
    assert first["kv_capacity_tokens"] == engine_server.config.max_total_tokens
    status, _ = await asyncio.to_thread(
        control, engine_server, "GET", f"{CONTROL_LOAD_PATH}?wait_s=x"
    )
    assert status == 400

    watcher = LoadWatcher("engine")
    async with contextlib.asynccontextmanager(watch)(watcher, engine_server.config):
        await wait_until(lambda: watcher.latest is not None, 60, what="the first load report")
        request = asyncio.create_task(asyncio.to_thread(_rt_request, engine_server))
        try:

            def rt_in_engine() -> Any:
                load = watcher.latest
                return load if load and load.num_rt_running + load.num_rt_waiting >= 1 else None

            seen = await wait_until(rt_in_engine, 120, what="the RT request in the watcher's view")

            def charged() -> Any:
                load = watcher.latest
                tenants = load.rt_by_tenant if load is not None else ()
                entry = next((t for t in tenants if t.tenant_id == "load-test"), None)
                return entry if entry is not None and entry.fair_counter > 0 else None

            # the tenant's fair-share counter, which the gateway's per-tenant forecast follows,
            # comes with the load once the policy has scheduled its tokens
            await wait_until(charged, 120, what="the tenant's fair-share counter in the load")
            # While it runs, a poll past the newest iteration returns a later one.
            later = await asyncio.to_thread(_load, engine_server, seen.iteration, 30)
            assert later["iteration"] > seen.iteration
            assert later["at_unix_s"] >= seen.at_unix_s
            assert await request == MAX_NEW_TOKENS
        finally:
            with contextlib.suppress(BaseException):
                await request

        def drained() -> bool:
            load = watcher.latest
            return load is not None and load.num_rt_running == 0 and load.num_rt_waiting == 0

        await wait_until(drained, 60, what="no RT request left in the watcher's view")
        assert watcher.latest is not None and watcher.latest.iteration > first["iteration"]
        # The engine's iteration log says what each iteration ran (the live bench fits its
        # simulator twin's engine to these): the request's decodes are there, with their time.
        status, log = await asyncio.to_thread(
            control, engine_server, "GET", f"{CONTROL_ITERATIONS_PATH}?after={first['iteration']}"
        )
        assert status == 200 and isinstance(log, dict)
        recent = msgspec.convert(log, RecentIterations)
        decoding = [r for r in recent.iterations if r.mix is not None and r.mix.num_decode >= 1]
        assert decoding and all(r.iteration_s > 0 for r in decoding)
        assert max(r.mix.decode_context for r in decoding if r.mix) >= MAX_NEW_TOKENS // 2
        # The measured staleness: iterations the engine ran that the watcher never saw.
        print(
            f"load watcher: {watcher.reports} reports, iterations "
            f"{first['iteration']}..{watcher.latest.iteration}, "
            f"missed {watcher.missed_iterations}"
        )
