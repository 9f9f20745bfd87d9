"""The operator dashboard: `GET /admin/v1/dashboard` (one static HTML page, its script and style
inline, no build step, nothing fetched from elsewhere: charts are drawn on canvas by the page) and
`GET /admin/v1/dashboard/data` (the JSON it draws).

Both need the admin token: as a bearer token like the rest of the admin API, or as the password
of HTTP Basic auth (any user name), so a browser can open the page: a 401 here asks for Basic
credentials, and the browser then sends them with the page's own data requests. The same holds
for a page opened as http://user:TOKEN@host/admin/v1/dashboard: the page asks for its data at
its own URL without the credentials (fetch() refuses a URL that carries them).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from gateway.engine.stats import EngineStatsWindow
from gateway.errors import ApiError
from gateway.reports import EngineTotals, engine_totals, tier_series, usage_report
from gateway.state import ADMIN_TOKEN, DB_ENGINE, ENGINE_STATS, METRICS, POOL, STORE

routes = web.RouteTableDef()
PAGE = Path(__file__).resolve().parent / "index.html"
"""The page (HTML with its script and style)."""
POINTS = 72
"""Periods per chart: the window is cut into this many buckets (whole minutes)."""
MAX_HOURS = 72
_encoder = msgspec.json.Encoder()


def check_dashboard_auth(request: web.Request) -> None:
    """401 (asking a browser for Basic credentials) unless the admin token is presented."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    token = value.strip()
    if scheme.lower() == "basic":
        try:
            token = base64.b64decode(token, validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            token = ""
    elif scheme.lower() != "bearer":
        token = ""
    expected = request.app[ADMIN_TOKEN].encode()
    if not token or not hmac.compare_digest(token.encode(), expected):
        raise ApiError(
            401,
            "the dashboard needs the admin token (bearer, or as the Basic-auth password)",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": 'Basic realm="tandem admin", charset="UTF-8"'},
        )


@routes.get("/admin/v1/dashboard")
async def dashboard_page(request: web.Request) -> web.Response:
    """The dashboard page (HTML)."""
    check_dashboard_auth(request)
    return web.Response(
        body=PAGE.read_bytes(),
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-store"},
    )


@routes.get("/admin/v1/dashboard/data")
async def dashboard_data(request: web.Request) -> web.Response:
    """Series of the last `hours` (default 6): per tenant, per tier, and the engine's load."""
    check_dashboard_auth(request)
    text = request.query.get("hours", "6")
    try:
        hours = float(text)
    except ValueError:
        hours = -1.0
    if not 0 < hours <= MAX_HOURS:
        raise ApiError(
            400,
            f"hours must be a number in (0, {MAX_HOURS}], got {text!r}",
            param="hours",
            code="invalid_value",
        )
    bucket_s = max(60, int(hours * 3600 / POINTS) // 60 * 60)
    end = datetime.now(UTC)
    start = datetime.fromtimestamp((end.timestamp() - hours * 3600) // bucket_s * bucket_s, UTC)
    db = request.app[DB_ENGINE]
    periods = await usage_report(db, start, end + timedelta(seconds=1), bucket_s)
    tiers = await tier_series(db, start, end + timedelta(seconds=1), bucket_s)
    tenants = await request.app[STORE].list_tenants(include_deleted=True)
    seen = {p.tenant_id for p in periods}
    payload: dict[str, Any] = {
        "generated_at": end,
        "start": start,
        "end": end,
        "bucket_s": bucket_s,
        "tenants": [
            {"id": t.id, "name": t.name, "tier": t.tier, "slo": t.slo, "quota": t.quota}
            for t in tenants
            if not t.deleted or t.id in seen
        ],
        "usage": [
            {**msgspec.structs.asdict(p), "t": int(p.period_start.timestamp())} for p in periods
        ],
        "tiers": tiers,
        "engine": _engine_history(request, start.timestamp()),
        "latency_model": _latency_model(request),
        "engines": _engines(request, await engine_totals(db, start, end + timedelta(seconds=1))),
    }
    return web.Response(
        body=_encoder.encode(payload),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _latency_model(request: web.Request) -> dict[str, float | None]:
    """The engine's latest latency-model errors (`EngineStatsWindow.latency_errors`); all None
    when the gateway reads no engine statistics (tandem's policy not in charge)."""
    window = request.app.get(ENGINE_STATS)
    if window is None:
        return EngineStatsWindow().latency_errors()
    return window.latency_errors()


def _engines(request: web.Request, totals: dict[str, EngineTotals]) -> list[dict[str, Any]]:
    """Each engine of the pool now: its state, restarts, load at the last sample and latency
    model's errors (None where unknown), and the requests it ran in the window (*totals*)."""
    sampler = request.app[METRICS].sampler
    last = sampler.history[-1] if sampler is not None and sampler.history else None
    sampled = {e.name: e for e in last.engines} if last is not None else {}
    out = []
    for replica in request.app[POOL].replicas:
        reading = sampled.get(replica.name)
        window = replica.stats or EngineStatsWindow()
        out.append(
            {
                "name": replica.name,
                "state": replica.state,
                "serving": replica.is_serving,
                "restarts": replica.health.restarts,
                "running": reading.running if reading is not None and reading.up else None,
                "waiting": reading.waiting if reading is not None and reading.up else None,
                "kv_usage": reading.kv_usage if reading is not None and reading.up else None,
                **window.latency_errors(),
                **msgspec.structs.asdict(
                    totals.get(
                        replica.name, EngineTotals(requests=0, errors=0, slo_attainment=None)
                    )
                ),
            }
        )
    return out


def _engine_history(request: web.Request, since_s: float) -> list[dict[str, Any]]:
    sampler = request.app[METRICS].sampler
    if sampler is None:
        return []
    cutoff = max(since_s, time.time() - 24 * 3600 * 3)
    return [
        {
            "t": s.time_s,
            "up": s.up,
            "kv_usage": s.kv_usage,
            "running": s.running,
            "waiting": s.waiting,
            "batch_lines_pending": s.batch_lines_pending,
        }
        for s in sampler.history
        if s.time_s >= cutoff
    ]
