"""Admin REST API (`/admin/v1`, bearer `TANDEM_ADMIN_TOKEN`): tenants, keys, SLO contracts,
quotas, the latest requests, and cancelling any tenant's batch."""

from __future__ import annotations

import hmac
import math
from datetime import UTC, datetime
from typing import Literal

import msgspec
from aiohttp import web

from gateway.api.batches import batch_not_found, cancel
from gateway.api.schemas import decode_body
from gateway.auth import bearer_token
from gateway.batch.app import BATCH_STORE
from gateway.errors import ApiError
from gateway.reports import BadQuery, parse_query, to_csv, usage_report
from gateway.state import ADMIN_TOKEN, AUTH, DB_ENGINE, STORE
from gateway.store.errors import Conflict, NotFound
from gateway.store.types import OnUnattainable, Quota, Slo, Tenant

routes = web.RouteTableDef()
PREFIX = "/admin/v1"
_encoder = msgspec.json.Encoder()
_MAX_REQUESTS_LIMIT = 1000


# SloIn has no class docstring on purpose: msgspec would publish it in /openapi.json.
class SloIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Python names are the contract's (*_target_ms); the JSON keys are API.md's ("ttft_ms", ...).
    ttft_target_ms: float | None = msgspec.field(default=None, name="ttft_ms")
    """RT: time-to-first-token target, ms after arrival. JSON key "ttft_ms"."""
    tpot_target_ms: float | None = msgspec.field(default=None, name="tpot_ms")
    """RT: time-per-output-token target after the first token, ms. JSON key "tpot_ms"."""
    deadline_s: float | None = None
    """BE: job deadline, seconds after arrival (None: pure best effort)."""
    allow_rt: bool = False
    """Whether a BE tenant may ask for tier "rt" per request (needs both RT targets)."""
    on_unattainable: OnUnattainable = "reject"
    """What the gateway does with an RT request its admission forecast says will miss the
    targets at the engine's current load: "reject" (429 `slo_unattainable` with Retry-After, at
    once), "downgrade" (run it as BE; the response carries `X-Tandem-Downgraded`) or "accept"
    (run it as RT anyway, best effort). Only for tenants with RT requests (tier "rt", or
    allow_rt)."""
    weight: float = 1.0
    """The tenant's weight in the engine's fair share between tenants (> 0, relative to the
    other tenants' weights)."""


# (Python name, JSON key) of every positive number in a contract, for the 422's param.
_SLO_NUMBERS = (
    ("ttft_target_ms", "ttft_ms"),
    ("tpot_target_ms", "tpot_ms"),
    ("deadline_s", "deadline_s"),
)


class QuotaIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Limits; null = unlimited. In a PATCH a limit left out keeps its current value."""

    requests_per_min: int | msgspec.UnsetType | None = msgspec.UNSET
    tokens_per_min: int | msgspec.UnsetType | None = msgspec.UNSET
    max_concurrent: int | msgspec.UnsetType | None = msgspec.UNSET
    monthly_tokens: int | msgspec.UnsetType | None = msgspec.UNSET

    def over(self, current: Quota) -> Quota:
        """The limits given here, the others from *current* (unset = keep; null = unlimited)."""
        fields = msgspec.structs.asdict(current)
        fields.update(
            {k: v for k, v in msgspec.structs.asdict(self).items() if v is not msgspec.UNSET}
        )
        return Quota(**fields)


class TenantCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    tier: Literal["rt", "be"]
    slo: SloIn = msgspec.field(default_factory=SloIn)
    quota: QuotaIn = msgspec.field(default_factory=QuotaIn)


class TenantPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None
    tier: Literal["rt", "be"] | None = None
    slo: SloIn | None = None
    quota: QuotaIn | None = None


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None


MAX_NAME_CHARS = 100
"""Longest tenant or key name, characters (the columns hold 200)."""
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_QUOTA_MAX = {
    "requests_per_min": _INT32_MAX,
    "tokens_per_min": _INT64_MAX,
    "max_concurrent": _INT32_MAX,
    "monthly_tokens": _INT64_MAX,
}
"""The largest value of each quota limit: its column's integer type (INTEGER or BIGINT in
PostgreSQL); a larger one fails the insert."""


def check_name(param: str, name: str) -> None:
    """422 naming *param* unless *name* is 1 to MAX_NAME_CHARS characters, not all blank, without
    a NUL (no PostgreSQL text column stores one)."""
    if not name.strip() or len(name) > MAX_NAME_CHARS:
        raise _invalid(param, f"{param} must be 1 to {MAX_NAME_CHARS} characters")
    if "\x00" in name:
        raise _invalid(param, f"{param} must not contain a NUL character (\\u0000)")


def check_admin(request: web.Request) -> None:
    """401 unless the request carries the admin token."""
    token = bearer_token(request)
    if not hmac.compare_digest(token.encode(), request.app[ADMIN_TOKEN].encode()):
        raise ApiError(401, "invalid admin token", code="invalid_admin_token")


def validate_tenant(name: str, tier: str, slo: SloIn, quota: QuotaIn | Quota) -> tuple[Slo, Quota]:
    """Checks a tenant's contract and quota; 422 naming the field."""
    check_name("name", name)
    if tier == "rt" and (slo.ttft_target_ms is None or slo.tpot_target_ms is None):
        raise _invalid("slo", "an rt tenant needs slo.ttft_ms and slo.tpot_ms")
    if slo.allow_rt and (slo.ttft_target_ms is None or slo.tpot_target_ms is None):
        raise _invalid("slo.allow_rt", "allow_rt needs slo.ttft_ms and slo.tpot_ms")
    for attr, key in _SLO_NUMBERS:
        value = getattr(slo, attr)
        if value is not None and value <= 0:
            raise _invalid(f"slo.{key}", f"slo.{key} must be positive, got {value}")
    if not (math.isfinite(slo.weight) and slo.weight > 0):
        raise _invalid("slo.weight", f"slo.weight must be a positive number, got {slo.weight}")
    if slo.on_unattainable != "reject" and tier != "rt" and not slo.allow_rt:
        # every tenant may run BE (resolve_tier: a looser tier is always allowed), so a
        # downgrade is never refused for that; but a tenant without RT requests has nothing the
        # SLO admission would ever judge, and a setting that can never apply is refused
        raise _invalid(
            "slo.on_unattainable",
            f"slo.on_unattainable {slo.on_unattainable!r} applies to RT requests; a be tenant "
            "without slo.allow_rt has none",
        )
    limits = quota.over(Quota()) if isinstance(quota, QuotaIn) else quota
    for field, most in _QUOTA_MAX.items():
        value = getattr(limits, field)
        if value is not None and not 0 <= value <= most:
            raise _invalid(f"quota.{field}", f"quota.{field} must be in [0, {most}], got {value}")
    return (
        Slo(
            ttft_target_ms=slo.ttft_target_ms,
            tpot_target_ms=slo.tpot_target_ms,
            deadline_s=slo.deadline_s,
            allow_rt=slo.allow_rt,
            on_unattainable=slo.on_unattainable,
            weight=float(slo.weight),
        ),
        limits,
    )


@routes.post(f"{PREFIX}/tenants")
async def create_tenant(request: web.Request) -> web.Response:
    check_admin(request)
    body = decode_body(await request.read(), TenantCreate)
    assert isinstance(body, TenantCreate)
    slo, quota = validate_tenant(body.name, body.tier, body.slo, body.quota)
    try:
        tenant = await request.app[STORE].create_tenant(body.name.strip(), body.tier, slo, quota)
    except Conflict as exc:
        raise ApiError(409, str(exc), param="name", code="tenant_exists") from None
    return _json(tenant, status=201)


@routes.get(f"{PREFIX}/tenants")
async def list_tenants(request: web.Request) -> web.Response:
    check_admin(request)
    tenants = await request.app[STORE].list_tenants()
    return _json({"object": "list", "data": tenants})


@routes.get(f"{PREFIX}/tenants/{{tenant_id}}")
async def get_tenant(request: web.Request) -> web.Response:
    check_admin(request)
    return _json(await _tenant_or_404(request))


@routes.patch(f"{PREFIX}/tenants/{{tenant_id}}")
async def patch_tenant(request: web.Request) -> web.Response:
    check_admin(request)
    current = await _tenant_or_404(request)
    body = decode_body(await request.read(), TenantPatch)
    assert isinstance(body, TenantPatch)
    tier = body.tier or current.tier
    slo_in = body.slo or SloIn(**msgspec.structs.asdict(current.slo))
    quota_in = body.quota.over(current.quota) if body.quota is not None else current.quota
    slo, quota = validate_tenant(body.name or current.name, tier, slo_in, quota_in)
    try:
        tenant = await request.app[STORE].update_tenant(
            current.id,
            name=body.name.strip() if body.name else None,
            tier=body.tier,
            slo=slo,
            quota=quota,
        )
    except Conflict as exc:
        raise ApiError(409, str(exc), param="name", code="tenant_exists") from None
    request.app[AUTH].invalidate()
    return _json(tenant)


@routes.delete(f"{PREFIX}/tenants/{{tenant_id}}")
async def delete_tenant(request: web.Request) -> web.Response:
    check_admin(request)
    tenant_id = request.match_info["tenant_id"]
    if not await request.app[STORE].delete_tenant(tenant_id):
        raise _not_found("tenant", tenant_id)
    request.app[AUTH].invalidate()
    return _json({"id": tenant_id, "object": "tenant", "deleted": True})


@routes.post(f"{PREFIX}/tenants/{{tenant_id}}/keys")
async def create_key(request: web.Request) -> web.Response:
    check_admin(request)
    tenant = await _tenant_or_404(request)
    raw = await request.read()
    body = decode_body(raw, KeyCreate) if raw.strip() else KeyCreate()
    assert isinstance(body, KeyCreate)
    if body.name is not None and body.name.strip():  # a blank key name is no name
        check_name("name", body.name)
    try:
        key, secret = await request.app[STORE].create_key(tenant.id, name=body.name)
    except NotFound:
        raise _not_found("tenant", tenant.id) from None
    return _json(
        {
            "id": key.id,
            "key": secret,
            "prefix": key.prefix,
            "tenant_id": tenant.id,
            "name": key.name,
            "created_at": key.created_at,
        },
        status=201,
    )


@routes.get(f"{PREFIX}/tenants/{{tenant_id}}/keys")
async def list_keys(request: web.Request) -> web.Response:
    check_admin(request)
    tenant = await _tenant_or_404(request)
    return _json({"object": "list", "data": await request.app[STORE].list_keys(tenant.id)})


@routes.delete(f"{PREFIX}/keys/{{key_id}}")
async def revoke_key(request: web.Request) -> web.Response:
    check_admin(request)
    key_id = request.match_info["key_id"]
    key = await request.app[STORE].revoke_key(key_id)
    if key is None:
        raise _not_found("key", key_id)
    request.app[AUTH].invalidate(key.prefix)
    return _json(key)


@routes.get(f"{PREFIX}/requests")
async def latest_requests(request: web.Request) -> web.Response:
    check_admin(request)
    tenant_id = request.query.get("tenant") or None
    limit_text = request.query.get("limit", "100")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= _MAX_REQUESTS_LIMIT:
        raise ApiError(
            400,
            f"limit must be an integer in [1, {_MAX_REQUESTS_LIMIT}]",
            param="limit",
            code="invalid_value",
        )
    engine = request.query.get("engine") or None
    records = await request.app[STORE].latest_requests(tenant_id, int(limit_text), engine)
    return _json({"object": "list", "data": records})


@routes.get(f"{PREFIX}/usage")
async def usage(request: web.Request) -> web.Response:
    """Usage per tenant and day or hour, as JSON or CSV (see gateway.reports)."""
    check_admin(request)
    try:
        query = parse_query(request.query, datetime.now(UTC))
    except BadQuery as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    tenant_id = None
    if query.tenant is not None:
        tenant_id = await _resolve_tenant(request, query.tenant)
    rows = await usage_report(
        request.app[DB_ENGINE], query.start, query.end, query.bucket_s, tenant_id, query.engine
    )
    if query.format == "csv":
        return web.Response(
            text=to_csv(rows),
            content_type="text/csv",
            headers={"Content-Disposition": 'attachment; filename="usage.csv"'},
        )
    return _json(
        {
            "object": "list",
            "group_by": query.group_by,
            "start": query.start,
            "end": query.end,
            "data": rows,
        }
    )


@routes.post(f"{PREFIX}/batches/{{batch_id}}/cancel")
async def cancel_any_batch(request: web.Request) -> web.Response:
    """Cancels any tenant's batch, as its tenant's own cancel does (e.g. a batch whose lines
    take the engine down for everyone): the batch object, or 404 / 409."""
    check_admin(request)
    batch_id = request.match_info["batch_id"]
    batch = await request.app[BATCH_STORE].get_batch(batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    return web.json_response((await cancel(request.app, batch)).to_openai())


async def _resolve_tenant(request: web.Request, ident: str) -> str:
    """A tenant id from an id or a name (deleted tenants included: their usage stays)."""
    store = request.app[STORE]
    tenant = await store.get_tenant(ident, include_deleted=True)
    if tenant is not None:
        return tenant.id
    named = [t for t in await store.list_tenants(include_deleted=True) if t.name == ident]
    if not named:
        raise ApiError(404, f"tenant {ident!r} not found", param="tenant", code="tenant_not_found")
    live = [t for t in named if not t.deleted]
    return (live or named)[-1].id


async def _tenant_or_404(request: web.Request) -> Tenant:
    tenant_id = request.match_info["tenant_id"]
    tenant = await request.app[STORE].get_tenant(tenant_id)
    if tenant is None:
        raise _not_found("tenant", tenant_id)
    return tenant


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(
        body=_encoder.encode(payload), status=status, content_type="application/json"
    )


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(422, message, param=param, code="invalid_value")


def _not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"{kind} {ident!r} not found", code=f"{kind}_not_found")
