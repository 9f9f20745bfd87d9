"""Operations endpoints (no prefix, no auth): liveness and readiness."""

from __future__ import annotations

import time

from aiohttp import web

from gateway.state import DB_ENGINE, ENGINE_HEALTH
from gateway.store.migrate import current_revision, head_revision

routes = web.RouteTableDef()


@routes.get("/healthz")
@routes.get("/health")
async def healthz(request: web.Request) -> web.Response:
    """Liveness: the gateway process answers (`/health` is the alias benchmark clients probe)."""
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 only when the engine answers and the database is at the newest migration.

    The engine's side is its health as last seen (`gateway.engine.health`: its supervisor's
    view, or the gateway's own probe), never a round trip to the engine: a probe that is
    polled often costs the engine nothing. While the engine is not up, `engine` says why."""
    health = request.app[ENGINE_HEALTH]
    engine_ok = health.is_up
    try:
        revision = await current_revision(request.app[DB_ENGINE])
    except Exception:  # the database is unreachable: not ready, and say so
        revision = None
    head = head_revision()
    database_ok = revision == head
    checks = {
        "engine": "ok" if engine_ok else "unavailable",
        "database": "ok" if database_ok else f"at revision {revision}, head is {head}",
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
