"""The gateway's side of the patched engine's control endpoint (HTTP over a Unix socket).

The engine's admission predicts output lengths from per-key histories (Past-Future); the gateway
owns them in SQL (``length_history``). :func:`length_sync` is a cleanup context that keeps the two
in step: once the engine's control endpoint answers, it pushes every key's newest window
(``usage.length_history_window``), and it pushes again whenever the endpoint reports a new
``boot_id`` (the engine restarted and lost its in-memory history). Between pushes the engine
learns from the requests it finishes itself, so nothing is pushed per request.

Several gateways in front of one engine each push at start-up; the engine takes the lengths as
observations, so a repeated push only re-weights the window towards recent values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from backend.wire import (
    CONTROL_HEALTH_PATH,
    CONTROL_LENGTHS_PATH,
    CONTROL_STATS_PATH,
    LengthHistoryPush,
)
from gateway.state import CONFIG, STORE

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 5.0
"""How often the gateway checks whether the engine (re)started."""
REQUEST_TIMEOUT_S = 30.0


class EngineControl:
    """Client of one engine's control endpoint."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineControl:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket_path),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def boot_id(self) -> str | None:
        """The engine's boot id, or None when its control endpoint does not answer."""
        try:
            body = await self._get(CONTROL_HEALTH_PATH)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        value = body.get("boot_id")
        return value if isinstance(value, str) else None

    async def stats(self) -> dict[str, Any]:
        """The in-engine policy's counters."""
        return await self._get(CONTROL_STATS_PATH)

    async def push_lengths(self, histories: dict[str, list[int]]) -> None:
        """Sends output-length histories (raises on an error reply)."""
        body = msgspec.json.encode(LengthHistoryPush(histories=histories))
        assert self._session is not None
        async with self._session.post(f"http://engine{CONTROL_LENGTHS_PATH}", data=body,
                                      headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 202:
                raise RuntimeError(f"engine refused the length-history push: HTTP {resp.status}"
                                   f" {await resp.text()}")

    async def _get(self, path: str) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(f"http://engine{path}") as resp:
            resp.raise_for_status()
            body = await resp.json()
        return body if isinstance(body, dict) else {}


async def sync_once(control: EngineControl, app: web.Application,
                    pushed_to: str | None) -> str | None:
    """Pushes the SQL histories if the engine is up and has not had them; returns the boot id
    they were pushed to (or *pushed_to* unchanged)."""
    boot = await control.boot_id()
    if boot is None or boot == pushed_to:
        return pushed_to
    window = app[CONFIG].usage.length_history_window
    histories = await app[STORE].all_length_histories(window)
    await control.push_lengths(histories)
    logger.info("pushed %d length histories (%d lengths) to engine %s", len(histories),
                sum(len(v) for v in histories.values()), boot)
    return boot


async def _sync_loop(app: web.Application) -> None:
    async with EngineControl(app[CONFIG].engine.control_socket_path) as control:
        pushed_to: str | None = None
        while True:
            try:
                pushed_to = await sync_once(control, app, pushed_to)
            except Exception:  # the engine or the database may be down: retry later
                logger.exception("length-history sync failed; retrying")
            await asyncio.sleep(CHECK_INTERVAL_S)


async def length_sync(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: keeps the engine's length histories in step with SQL."""
    task = None
    if app[CONFIG].engine.policy_in_charge:
        task = asyncio.create_task(_sync_loop(app), name="tandem-length-sync")
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
