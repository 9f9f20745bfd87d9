"""Operations endpoints (no prefix, no auth): liveness and readiness."""

from __future__ import annotations

from aiohttp import web

from gateway.state import DB_ENGINE, ENGINE
from gateway.store.migrate import current_revision, head_revision

routes = web.RouteTableDef()


@routes.get("/healthz")
@routes.get("/health")
async def healthz(request: web.Request) -> web.Response:
    """Liveness: the gateway process answers (`/health` is the alias benchmark clients probe)."""
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 only when the engine answers and the database is at the newest migration."""
    engine_ok = await request.app[ENGINE].is_healthy()
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
    return web.json_response(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status=200 if ready else 503,
    )
