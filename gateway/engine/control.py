"""The gateway's side of the patched engine's control endpoint (HTTP over a Unix socket).

The engine's admission predicts output lengths from per-key histories (Past-Future); the gateway
owns them in SQL (``length_history``). :func:`length_sync` is a cleanup context that keeps the two
in step every ``CHECK_INTERVAL_S``: when the engine's control endpoint first answers (or reports a
new ``boot_id``: it restarted and lost its memory) every key's newest window
(``usage.length_history_window``) is pushed; after that only the keys with rows newer than the
last push. A push replaces the key's history in the engine, and SQL already holds what the engine
finished itself (the usage recorder writes it), so nothing is counted twice; between pushes the
engine learns from its own finished requests at once. Several gateways sharing one database push
the same SQL truth, so their pushes agree.
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

from common.wire import (
    CONTROL_HEALTH_PATH,
    CONTROL_LENGTHS_PATH,
    CONTROL_STATS_PATH,
    LengthHistoryPush,
)
from gateway.engine.pool import merged_by_engine
from gateway.engine.stats import EngineStatsWindow
from gateway.state import CONFIG, ENGINE_STATS, METRICS, POOL, STORE
from gateway.store.repo import Store

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
"""How often the gateway syncs: an engine restart or another gateway's writes show up this late
at most (one indexed query when nothing changed)."""
REQUEST_TIMEOUT_S = 30.0


class EngineControl:
    """Client of one engine's control endpoint."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineControl:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket_path),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )
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
        async with self._session.post(
            f"http://engine{CONTROL_LENGTHS_PATH}",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as resp:
            if resp.status != 202:
                raise RuntimeError(
                    f"engine refused the length-history push: HTTP {resp.status}"
                    f" {await resp.text()}"
                )

    async def _get(self, path: str) -> dict[str, Any]:
        assert self._session is not None
        async with self._session.get(f"http://engine{path}") as resp:
            resp.raise_for_status()
            body = await resp.json()
        return body if isinstance(body, dict) else {}


class LengthSync:
    """What this gateway has pushed to the engine: which engine (boot id) and up to which SQL
    row; each :meth:`step` sends what changed since."""

    def __init__(self, control: EngineControl, store: Store, window: int) -> None:
        self.control = control
        self.store = store
        self.window = window
        self.boot_id: str | None = None
        self.after_id = 0
        self.engine_up = False
        """Whether the engine's control endpoint answered the last step."""

    async def step(self) -> int:
        """One sync: everything for a new engine, else the keys that changed; returns the
        number of keys pushed (0 when the engine is down or nothing changed)."""
        boot = await self.control.boot_id()
        self.engine_up = boot is not None
        if boot is None:
            return 0
        if boot != self.boot_id:
            keys, newest = await self.store.length_keys_changed(0)
        else:
            keys, newest = await self.store.length_keys_changed(self.after_id)
        if keys:
            histories = await self.store.length_histories(keys, self.window)
            await self.control.push_lengths(histories)
            logger.info(
                "pushed %d length histories (%d lengths) to engine %s",
                len(histories),
                sum(len(v) for v in histories.values()),
                boot,
            )
        self.boot_id, self.after_id = boot, newest
        return len(keys)


async def _sync_loop(app: web.Application, socket_path: str, window: EngineStatsWindow) -> None:
    config = app[CONFIG]
    async with EngineControl(socket_path) as control:
        sync = LengthSync(control, app[STORE], config.usage.length_history_window)
        while True:
            try:
                await sync.step()
                if sync.engine_up:
                    window.add(await control.stats())
            except Exception:  # the engine or the database may be down: retry later
                logger.exception("engine control sync failed; retrying")
            await asyncio.sleep(CHECK_INTERVAL_S)


async def length_sync(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: keeps each engine's length histories in step with SQL, and its counters
    on ``/metrics`` (`gateway.engine.stats`; label `engine` when the pool has several), for
    every engine of the pool whose control endpoint the gateway reaches."""
    tasks = []
    if app[CONFIG].engine.policy_in_charge:
        pool = app[POOL]
        for replica in pool.replicas:
            socket_path = replica.control_socket
            if socket_path is None:
                continue
            replica.stats = EngineStatsWindow()
            tasks.append(
                asyncio.create_task(
                    _sync_loop(app, socket_path, replica.stats),
                    name=f"tandem-length-sync-{replica.index}",
                )
            )
        windows = [(r.name, r.stats) for r in pool.replicas if r.stats is not None]
        if windows:
            app[ENGINE_STATS] = windows[0][1]
        if METRICS in app and len(windows) == 1:
            app[METRICS].extra.append(windows[0][1].collect)
        elif METRICS in app and windows:
            app[METRICS].extra.append(
                lambda: merged_by_engine((name, window.collect) for name, window in windows)
            )
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
