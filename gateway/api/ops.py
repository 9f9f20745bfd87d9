"""Operations endpoints (no prefix, no auth): liveness and readiness."""

from __future__ import annotations

import time

from aiohttp import web

from gateway.engine.pool import EngineReplica
from gateway.state import DRAIN, POOL
from gateway.store.readiness import DATABASE_READINESS

routes = web.RouteTableDef()


@routes.get("/healthz")
@routes.get("/health")
async def healthz(request: web.Request) -> web.Response:
    """Liveness: the gateway process answers (`/health` is the alias benchmark clients probe)."""
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 only when at least one engine serves, the database is at the newest
    migration, and the gateway is not shutting down (`checks.gateway`: "shutting_down" while
    it drains the requests in flight: gateway/shutdown.py).

    Answered from memory, without I/O: the engines' side is their health as last seen
    (`gateway.engine.pool`: their supervisors' view, or the gateway's own probes), the
    database's its last background check (`gateway.store.readiness`). A probe polled often
    under load costs the engines and the database nothing, and waits behind nothing. While no
    engine serves, `engine` says why (the first one's state); with several engines, `engines`
    lists each one's."""
    pool = request.app[POOL]
    engine_ok = pool.is_serving
    database = request.app[DATABASE_READINESS]
    database_ok = database.is_ready
    checks = {
        "engine": "ok" if engine_ok else "unavailable",
        "database": database.describe(),
    }
    draining = request.app[DRAIN].is_draining
    if draining:  # stopping: a load balancer should send its clients elsewhere
        checks["gateway"] = "shutting_down"
    ready = engine_ok and database_ok and not draining
    body: dict[str, object] = {"status": "ready" if ready else "not_ready", "checks": checks}
    if not engine_ok:
        body["engine"] = _replica_state(pool.replicas[0])
    if len(pool) > 1:
        body["engines"] = [
            {"name": r.name, "serving": r.is_serving, **_replica_state(r)} for r in pool.replicas
        ]
    return web.json_response(body, status=200 if ready else 503)


def _replica_state(replica: EngineReplica) -> dict[str, object]:
    health = replica.health
    return {
        "state": replica.state,
        "detail": health.detail,
        "restarts": health.restarts,
        "down_for_s": round(time.monotonic() - health.changed_at, 1),
    }
