"""The operations `/openapi.json` describes: one `Op` per route the gateway serves.

Add an `Op` to `OPERATIONS` for every new route (a test enumerates the app's router and fails for
any route missing here); gateway.api.openapi turns them into the document's paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REF_TEMPLATE = "#/components/schemas/{name}"
"""Where the document keeps a named schema."""

Security = list[dict[str, list[str]]]
TENANT: Security = [{"tenantKey": []}]
ADMIN: Security = [{"adminToken": []}]
DASHBOARD: Security = [{"adminToken": []}, {"adminBasic": []}]
NONE: Security = []


@dataclass(frozen=True)
class Op:
    """One documented operation."""

    method: str
    path: str
    summary: str
    tag: str
    security: list[dict[str, list[str]]]
    body: str | None = None
    """Name of the request body's schema (a Struct in gateway.api.openapi's `_STRUCTS`)."""
    body_type: str = "application/json"
    response: dict[str, Any] | None = None
    """Schema of the 200/201 body (default: a free-form JSON object)."""
    response_type: str = "application/json"
    status: int = 200
    query: list[tuple[str, str, str]] = field(default_factory=list)
    """(name, JSON type, description) of query parameters."""
    errors: tuple[int, ...] = (400, 401, 404, 422)


def schema_ref(name: str) -> dict[str, Any]:
    """A reference to the named schema of the document's components."""
    return {"$ref": REF_TEMPLATE.format(name=name)}


def list_of(name: str) -> dict[str, Any]:
    """An OpenAI-style list object (``{"object": "list", "data": [...]}``) of the named schema."""
    return {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": schema_ref(name)},
        },
    }


_USAGE_QUERY = [
    ("tenant", "string", "tenant id or name (default: all tenants)"),
    (
        "start",
        "string",
        "ISO 8601 start (inclusive, UTC if no zone; default: 30 days / 24 hours before end)",
    ),
    ("end", "string", "ISO 8601 end (exclusive; default: now)"),
    ("group_by", "string", "day (default) or hour"),
    ("format", "string", "json (default) or csv"),
]
_GEN_ERRORS = (400, 401, 403, 422, 429, 503)

OPERATIONS: list[Op] = [
    # operations
    Op("GET", "/healthz", "Liveness", "operations", NONE, errors=()),
    Op(
        "GET",
        "/health",
        "Liveness (alias probed by benchmark clients)",
        "operations",
        NONE,
        errors=(),
    ),
    Op(
        "GET",
        "/readyz",
        "Readiness: 200 when the engine answers and the database is at the "
        "newest migration, else 503",
        "operations",
        NONE,
        errors=(503,),
    ),
    Op(
        "GET",
        "/metrics",
        "Prometheus metrics (text format)",
        "operations",
        NONE,
        response={"type": "string"},
        response_type="text/plain",
        errors=(),
    ),
    Op("GET", "/openapi.json", "This document", "operations", NONE, errors=()),
    # OpenAI-compatible
    Op("GET", "/v1/models", "The served model", "openai", TENANT, errors=(401,)),
    Op(
        "POST",
        "/v1/chat/completions",
        "Chat completion (stream: true gives SSE chunks ending in "
        "data: [DONE]); over a quota: 429 with Retry-After, the error code names the limit",
        "openai",
        TENANT,
        body="ChatCompletionRequest",
        errors=_GEN_ERRORS,
    ),
    Op(
        "POST",
        "/v1/completions",
        "Text completion (streaming as for chat)",
        "openai",
        TENANT,
        body="CompletionRequest",
        errors=_GEN_ERRORS,
    ),
    Op(
        "POST",
        "/v1/files",
        "Upload a JSONL file (purpose batch)",
        "batch",
        TENANT,
        body_type="multipart/form-data",
        errors=(400, 401, 413, 422),
    ),
    Op("GET", "/v1/files", "The tenant's files", "batch", TENANT, errors=(401,)),
    Op("GET", "/v1/files/{file_id}", "A file's metadata", "batch", TENANT),
    Op("DELETE", "/v1/files/{file_id}", "Delete a file", "batch", TENANT),
    Op(
        "GET",
        "/v1/files/{file_id}/content",
        "A file's content",
        "batch",
        TENANT,
        response={"type": "string"},
        response_type="application/octet-stream",
    ),
    Op(
        "POST",
        "/v1/batches",
        "Create a batch from an uploaded file (OpenAI Batch semantics)",
        "batch",
        TENANT,
        errors=(400, 401, 404, 422, 429),
    ),
    Op(
        "GET",
        "/v1/batches",
        "The tenant's batches, newest first",
        "batch",
        TENANT,
        query=[("limit", "integer", "page size"), ("after", "string", "cursor: a batch id")],
    ),
    Op("GET", "/v1/batches/{batch_id}", "A batch", "batch", TENANT),
    Op("POST", "/v1/batches/{batch_id}/cancel", "Cancel a batch", "batch", TENANT),
    # admin
    Op(
        "POST",
        "/admin/v1/tenants",
        "Create a tenant with its SLO contract and quota",
        "admin",
        ADMIN,
        body="TenantCreate",
        response=schema_ref("Tenant"),
        status=201,
        errors=(400, 401, 409, 422),
    ),
    Op(
        "GET",
        "/admin/v1/tenants",
        "Live tenants",
        "admin",
        ADMIN,
        response=list_of("Tenant"),
        errors=(401,),
    ),
    Op(
        "GET",
        "/admin/v1/tenants/{tenant_id}",
        "A tenant",
        "admin",
        ADMIN,
        response=schema_ref("Tenant"),
    ),
    Op(
        "PATCH",
        "/admin/v1/tenants/{tenant_id}",
        "Change a tenant: name, tier, SLO or quota (a new quota applies without restart)",
        "admin",
        ADMIN,
        body="TenantPatch",
        response=schema_ref("Tenant"),
        errors=(400, 401, 404, 409, 422),
    ),
    Op(
        "DELETE",
        "/admin/v1/tenants/{tenant_id}",
        "Delete a tenant (its keys are revoked; its usage stays)",
        "admin",
        ADMIN,
    ),
    Op(
        "POST",
        "/admin/v1/tenants/{tenant_id}/keys",
        "Create an API key; the key is shown only in this answer",
        "admin",
        ADMIN,
        body="KeyCreate",
        status=201,
    ),
    Op(
        "GET",
        "/admin/v1/tenants/{tenant_id}/keys",
        "A tenant's keys (prefixes only)",
        "admin",
        ADMIN,
        response=list_of("ApiKey"),
    ),
    Op(
        "DELETE",
        "/admin/v1/keys/{key_id}",
        "Revoke a key (effective immediately)",
        "admin",
        ADMIN,
        response=schema_ref("ApiKey"),
    ),
    Op(
        "GET",
        "/admin/v1/usage",
        "Usage per tenant and day or hour: requests, tokens, TTFT and "
        "TPOT p50/p99 (nearest rank), SLO attainment, errors; JSON or CSV",
        "admin",
        ADMIN,
        response={
            "type": "object",
            "properties": {
                "object": {"const": "list"},
                "group_by": {"enum": ["day", "hour"]},
                "start": {"type": "string", "format": "date-time"},
                "end": {"type": "string", "format": "date-time"},
                "data": {"type": "array", "items": schema_ref("UsagePeriod")},
            },
        },
        query=_USAGE_QUERY,
        errors=(400, 401, 404),
    ),
    Op(
        "GET",
        "/admin/v1/requests",
        "The latest usage records, newest first",
        "admin",
        ADMIN,
        response=list_of("UsageRecord"),
        query=[
            ("tenant", "string", "tenant id (default: all)"),
            ("limit", "integer", "1-1000, default 100"),
        ],
        errors=(400, 401),
    ),
    Op(
        "GET",
        "/admin/v1/dashboard",
        "The dashboard (HTML; admin token as bearer or as the Basic-auth password)",
        "admin",
        DASHBOARD,
        response={"type": "string"},
        response_type="text/html",
        errors=(401,),
    ),
    Op(
        "GET",
        "/admin/v1/dashboard/data",
        "The dashboard's series for the last hours",
        "admin",
        DASHBOARD,
        query=[("hours", "number", "window, (0, 72], default 6")],
        errors=(400, 401),
    ),
]
