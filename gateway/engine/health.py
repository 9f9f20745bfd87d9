"""What the gateway knows of an engine's health, kept current in the background so that reading it
costs nothing: placement and `/readyz` answer from it without a round trip to the engine, and
`/metrics` shows it (``tandem_engine_healthy``, ``tandem_engine_state``,
``tandem_engine_restarts_total``, collected by the pool, gateway/engine/pool.py;
``tandem_engine_up`` is the metrics sampler's, whether the engine answered its last load poll).
Each engine of the pool has one.

Two sources keep it current, never both:

* the engine's supervisor, when `tandem serve` launched the engine (`backend/launch/supervisor.py`,
  wired in `tandem/serve.py`): it sees the process exit the moment it does, probes its health,
  restarts it, and reports every change here;
* otherwise the gateway's own probe (`watch`): ``GET /health`` every
  ``engine.health_probe_interval_s``, and at once when a request found the engine gone
  (`suspect`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

FIRST_PROBE_TIMEOUT_S = 5.0
"""The gateway's first probe, before it serves, waits at most this long, seconds: a hung engine
must not hold the gateway's start-up for a whole probe timeout (it is probed again later)."""


class EngineHealth:
    """One engine's health as last seen (see the module docstring)."""

    def __init__(self, name: str, *, is_up: bool = False, state: str = "unknown") -> None:
        """*name*: the engine's name (its base URL, like `EngineHandle.name`)."""
        self.name = name
        self.is_up = is_up
        """Whether requests may be sent to it: it answered its last health probe."""
        self.state = state
        """A word: "up", "unreachable" (the gateway's probe failed), or a supervisor's phase
        ("unresponsive", "down", "restarting", "stopped"); "unknown" before the first probe."""
        self.detail = ""
        """One line for an operator: why it is not up, or how it came back."""
        self.restarts = 0
        """Times the supervisor restarted it (0 when the gateway does not supervise it)."""
        self.changed_at = time.monotonic()
        """When `is_up` last changed (monotonic seconds)."""
        self._suspect = asyncio.Event()

    def update(
        self, *, is_up: bool, state: str, detail: str = "", restarts: int | None = None
    ) -> None:
        """Records the engine's newest health."""
        if is_up != self.is_up:
            self.changed_at = time.monotonic()
        self.is_up, self.state, self.detail = is_up, state, detail
        if restarts is not None:
            self.restarts = restarts

    def suspect(self) -> None:
        """A request found the engine unreachable or lost it: the gateway's own probe (if it
        runs) looks again now instead of at its next interval."""
        self._suspect.set()

    async def watch(
        self, is_healthy: Callable[[float], Awaitable[bool]], interval_s: float, timeout_s: float
    ) -> None:
        """The gateway's own probe, until cancelled: ``is_healthy(timeout_s)`` every
        *interval_s*, or sooner when a request `suspect`s the engine."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await self._suspect.wait()
            self._suspect.clear()
            await self.probe(is_healthy, timeout_s)

    async def probe(self, is_healthy: Callable[[float], Awaitable[bool]], timeout_s: float) -> None:
        """One probe of the gateway's own: ``is_healthy(timeout_s)``, recorded."""
        if await is_healthy(timeout_s):
            self.update(is_up=True, state="up", detail="answers its health probe")
        else:
            self.update(is_up=False, state="unreachable", detail="did not answer its health probe")
