"""The OpenAPI 3.1 document of the public and admin API, served at `GET /openapi.json`.

Operations are described in gateway.api.openapi_ops, next to nothing else, and the document lists
those the running app has actually registered (so it never promises a route that is not there); a
test enumerates the app's router and fails for any route missing from `OPERATIONS`. Request and
response bodies that have a msgspec type take their schema from it, so field docs and types cannot
drift.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from gateway.api.admin import KeyCreate, TenantCreate, TenantPatch
from gateway.api.openapi_ops import OPERATIONS as OPERATIONS  # re-exported: tests import it here
from gateway.api.openapi_ops import REF_TEMPLATE, Op, schema_ref
from gateway.api.schemas import ChatCompletionRequest, CompletionRequest
from gateway.reports import UsagePeriod
from gateway.store.types import ApiKey, Tenant, UsageRecord

routes = web.RouteTableDef()
_STRUCTS: list[type[msgspec.Struct]] = [
    ChatCompletionRequest,
    CompletionRequest,
    TenantCreate,
    TenantPatch,
    KeyCreate,
    Tenant,
    ApiKey,
    UsageRecord,
    UsagePeriod,
]


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _ERROR_TEXT.get(status, "error"),
        "content": {"application/json": {"schema": schema_ref("Error")}},
    }
    if status in (429, 503):
        response["headers"] = {
            "Retry-After": {
                "schema": {"type": "integer"},
                "description": "seconds to wait before a retry",
            }
        }
    return response


_ERROR_TEXT = {
    400: "bad request",
    401: "missing or invalid credentials",
    403: "not allowed",
    404: "not found",
    409: "conflict",
    413: "body too large",
    422: "a field of the wrong type or value",
    429: "over a quota",
    503: "the engine is unavailable",
}


def _operation(op: Op) -> dict[str, Any]:
    success: dict[str, Any] = {
        "description": "ok",
        "content": {op.response_type: {"schema": op.response or {"type": "object"}}},
    }
    out: dict[str, Any] = {
        "summary": op.summary,
        "tags": [op.tag],
        "security": op.security,
        "operationId": f"{op.method.lower()}_{op.path.strip('/').replace('/', '_')}".replace(
            "{", ""
        )
        .replace("}", "")
        .replace(".", "_")
        .replace("-", "_"),
        "responses": {str(op.status): success, **{str(s): _error_response(s) for s in op.errors}},
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _path_params(op.path)
    ]
    params += [
        {"name": n, "in": "query", "required": False, "schema": {"type": t}, "description": d}
        for n, t, d in op.query
    ]
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {
            "required": op.method != "POST" or op.body != "KeyCreate",
            "content": {op.body_type: {"schema": schema_ref(op.body)}},
        }
    elif op.body_type == "multipart/form-data":
        out["requestBody"] = {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file", "purpose"],
                        "properties": {
                            "file": {"type": "string", "format": "binary"},
                            "purpose": {"const": "batch"},
                        },
                    }
                }
            },
        }
    return out


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def registered(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves (HEAD, added by aiohttp for GET, left out)."""
    out = set()
    for route in app.router.routes():
        info = route.resource.canonical if route.resource is not None else ""
        if route.method not in ("HEAD", "*"):
            out.add((route.method, info))
    return out


def document(app: web.Application | None = None) -> dict[str, Any]:
    """The OpenAPI document (of the operations *app* registers, or of all)."""
    served = registered(app) if app is not None else None
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=REF_TEMPLATE)
    schemas["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    }
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        if served is None or (op.method, op.path) in served:
            paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tandem",
            "version": "0.1.0",
            "description": "SLO-aware gateway for real-time and batch LLM traffic: the "
            "OpenAI-compatible API (tenant keys) and the admin API "
            "($TANDEM_ADMIN_TOKEN).",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "tenantKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a tenant's API key",
                },
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "TANDEM_ADMIN_TOKEN",
                },
                "adminBasic": {
                    "type": "http",
                    "scheme": "basic",
                    "description": "any user name, TANDEM_ADMIN_TOKEN as the password",
                },
            },
        },
    }


@routes.get("/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(document(request.app))
