"""Operations endpoints (no prefix, no auth): liveness and readiness."""

from __future__ import annotations

import time

from aiohttp import web

from gateway.state import ENGINE_HEALTH
from gateway.store.readiness import DATABASE_READINESS

routes = web.RouteTableDef()


@routes.get("/healthz")
@routes.get("/health")
async def healthz(request: web.Request) -> web.Response:
    """Liveness: the gateway process answers (`/health` is the alias benchmark clients probe)."""
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 only when the engine answers and the database is at the newest migration.

    Answered from memory, without I/O: the engine's side is its health as last seen
    (`gateway.engine.health`: its supervisor's view, or the gateway's own probe), the
    database's its last background check (`gateway.store.readiness`). A probe polled often
    under load costs the engine and the database nothing, and waits behind nothing. While the
    engine is not up, `engine` says why."""
    health = request.app[ENGINE_HEALTH]
    engine_ok = health.is_up
    database = request.app[DATABASE_READINESS]
    database_ok = database.is_ready
    checks = {
        "engine": "ok" if engine_ok else "unavailable",
        "database": database.describe(),
    }
    ready = engine_ok and database_ok
    body: dict[str, object] = {"status": "ready" if ready else "not_ready", "checks": checks}
    if not engine_ok:
        body["engine"] = {
            "state": health.state,
            "detail": health.detail,
            "restarts": health.restarts,
            "down_for_s": round(time.monotonic() - health.changed_at, 1),
        }
    return web.json_response(body, status=200 if ready else 503)
