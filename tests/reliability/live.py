"""A live gateway for the reliability tier: the real gateway app in front of the simulator, both
served by an event loop of their own in a background thread, so that synchronous HTTP clients
(schemathesis sends with `requests`) can call it from the test's thread.

Nothing here reaches into the gateway: the tests see it over HTTP only, as an attacker would.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.gateway.harness import ADMIN_TOKEN, running_gateway, serve, sim_app

FAST_SIM_TIME_SCALE = 0.01
"""The simulator's iterations take a hundredth of the profile's (H100) time: tens of µs, so a
generated request asking for thousands of tokens still ends within a few hundred ms."""

_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LiveGateway:
    """A running gateway, an RT tenant on it and that tenant's key."""

    base_url: str
    admin_token: str
    tenant_id: str
    tenant_key: str


@contextmanager
def live_gateway(tmp_path: Path, model_dir: Path, **env: str) -> Iterator[LiveGateway]:
    """The gateway (its own SQLite database in *tmp_path*, ``TANDEM_*`` overrides *env*) and the
    simulator, served in a background thread until the block ends; a tenant and a key are made
    through the admin API. Both servers stop when the block ends, also when it fails."""
    ready: dict[str, LiveGateway | BaseException] = {}
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with (
                serve(sim_app(FAST_SIM_TIME_SCALE)) as sim,
                running_gateway(tmp_path, model_dir, int(sim.port or 0), **env) as gw,
            ):
                tenant_id, key = await gw.new_tenant("fuzz", "rt")
                ready["gateway"] = LiveGateway(gw.base_url, ADMIN_TOKEN, tenant_id, key)
                started.set()
                await stop.wait()
        except BaseException as exc:
            ready["gateway"] = exc
            started.set()
            raise

    thread = threading.Thread(
        target=lambda: loop.run_until_complete(main()), name="live-gateway", daemon=True
    )
    thread.start()
    try:
        if not started.wait(_START_TIMEOUT_S):
            raise RuntimeError(f"the gateway did not start within {_START_TIMEOUT_S:.0f} s")
        gateway = ready["gateway"]
        if isinstance(gateway, BaseException):
            raise RuntimeError("the gateway failed to start") from gateway
        yield gateway
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(_START_TIMEOUT_S)
        loop.close()
