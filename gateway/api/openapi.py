"""The OpenAPI 3.1 document of the public and admin API, served at `GET /openapi.json`.

Every route the gateway serves is described by one `Op` in `OPERATIONS` (at the end of this
module): add one for every new route. The document lists those the running app has actually
registered (so it never promises a route that is not there); a test enumerates the app's router
and fails for any route missing from `OPERATIONS`. Request and response bodies that have a
msgspec type take their schema from it, so field docs and types cannot drift.

The schemas are as strict as the server: what the handlers refuse beyond the types (ranges,
enums, lengths, non-empty lists, which fields one another requires) is added to msgspec's schemas
by `_tighten`, so a body the document allows is refused only for what no schema can know (the
prompt's length against the context, the tenant's current contract in a PATCH, an id that does
not exist). tests/gateway/test_openapi_contract.py sends what the server refuses and checks the
document refuses it too, and sends generated schema-valid bodies and checks none gets a 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from gateway.api.admin import KeyCreate, TenantCreate, TenantPatch
from gateway.api.batches import MAX_METADATA_PAIRS, CreateBatchRequest
from gateway.api.schemas import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS_COMPLETIONS,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS_CHAT,
    NO_OP,
    REFUSED_CHAT,
    REFUSED_COMPLETIONS,
    REFUSED_MESSAGE_FIELDS,
    REFUSED_STREAM_OPTIONS,
    SCHEMA_NAME_PATTERN,
    SEED_NEEDS_GREEDY,
    TOOL_FIELDS,
    TOOL_PARAMETERS,
    ChatCompletionRequest,
    CompletionRequest,
    Refused,
    tool_refusal,
)
from gateway.batch.types import ENDPOINTS, FILE_PURPOSES
from gateway.reports import GROUP_BY_S, UsagePeriod
from gateway.state import CONFIG, TOKENIZER
from gateway.store.types import ApiKey, Tenant, UsageRecord

REF_TEMPLATE = "#/components/schemas/{name}"
"""Where the document keeps a named schema."""

# Security requirements of an operation: each names schemes of the document's securitySchemes.
Security = list[dict[str, list[str]]]
TENANT: Security = [{"tenantKey": []}]
ADMIN: Security = [{"adminToken": []}]
DASHBOARD: Security = [{"adminToken": []}, {"adminBasic": []}]
SCRAPE: Security = [{}, {"scrapeToken": []}, {"adminToken": []}]
"""/metrics: open, or (with metrics.scrape_token set) the scrape token or the admin token."""
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
    """Name of the request body's schema (a Struct in `_STRUCTS`)."""
    body_type: str = "application/json"
    response: dict[str, Any] | None = None
    """Schema of the 200/201 body (default: a free-form JSON object)."""
    response_type: str = "application/json"
    other_responses: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Other media types the success may come as: (type, schema), e.g. the server-sent events
    of `stream: true`, a report's CSV."""
    status: int = 200
    query: list[tuple[str, dict[str, Any], str]] = field(default_factory=list)
    """(name, JSON schema, description) of query parameters."""
    errors: tuple[int, ...] = (400, 401, 404, 422)
    success_headers: dict[str, Any] = field(default_factory=dict)
    """Headers of the success beyond `x-request-id` (which every response has)."""


_REQUEST_ID_HEADER = {
    "x-request-id": {
        "schema": {"type": "string"},
        "description": "the gateway's id of the request (a generation's usage record "
        "request_id; its body id is chatcmpl-/cmpl- + it)",
    }
}
_RATE_LIMIT_HEADERS = {
    f"x-ratelimit-{what}-{unit}": {
        "schema": {"type": "string" if what == "reset" else "integer"},
        "description": f"{text} (only when the tenant has a {unit} per minute limit)",
    }
    for unit in ("requests", "tokens")
    for what, text in (
        ("limit", f"the tenant's {unit} per minute"),
        ("remaining", f"{unit} this gateway admits now"),
        ("reset", "time until the limit is whole again, e.g. 1s, 250ms, 6m0s"),
    )
}


_SSE = (
    "text/event-stream",
    {
        "description": "with stream: true: `data: <chunk>` events (a chat.completion.chunk or "
        "text_completion object; an error object when the run fails), then `data: [DONE]`"
    },
)
"""A generation's streamed answer."""


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


routes = web.RouteTableDef()
_STRUCTS: list[type[msgspec.Struct]] = [
    ChatCompletionRequest,
    CompletionRequest,
    TenantCreate,
    TenantPatch,
    KeyCreate,
    CreateBatchRequest,
    Tenant,
    ApiKey,
    UsageRecord,
    UsagePeriod,
]


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": _ERROR_TEXT.get(status, "error"),
        "content": {"application/json": {"schema": schema_ref("Error")}},
        "headers": dict(_REQUEST_ID_HEADER),
    }
    if status in (429, 503):
        response["headers"] |= {
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
        "headers": {**_REQUEST_ID_HEADER, **op.success_headers},
        "content": {
            op.response_type: {"schema": op.response or {"type": "object"}},
            **{kind: {"schema": schema} for kind, schema in op.other_responses},
        },
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
        {"name": n, "in": "query", "required": False, "schema": s, "description": d}
        for n, s, d in op.query
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


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def _number(low: float, high: float | None = None, *, low_open: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", ("exclusiveMinimum" if low_open else "minimum"): low}
    if high is not None:
        out["maximum"] = high
    return out


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _requires_targets(schema: dict[str, Any]) -> dict[str, Any]:
    """*schema* (of a contract) with both RT targets required, as numbers."""
    return {
        **schema,
        "required": ["ttft_ms", "tpot_ms"],
        "properties": {"ttft_ms": {"type": "number"}, "tpot_ms": {"type": "number"}},
    }


_SAMPLING: dict[str, dict[str, Any]] = {
    "max_tokens": _nullable(_integer(1, INT32_MAX)),
    "temperature": _nullable(_number(0.0, 2.0)),
    "top_p": _nullable(_number(0.0, 1.0, low_open=True)),
    "n": {"type": "integer", "const": 1, "default": 1},
    "stop": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "maxItems": MAX_STOP_SEQUENCES,
            },
            {"type": "null"},
        ],
        "default": None,
    },
    "seed": _nullable(_integer(INT64_MIN, INT64_MAX)),
    "presence_penalty": _nullable(_number(-2.0, 2.0)),
    "frequency_penalty": _nullable(_number(-2.0, 2.0)),
    "top_k": {
        "anyOf": [{"const": -1}, _integer(1, INT32_MAX), {"type": "null"}],
        "default": None,
    },
    "min_p": _nullable(_number(0.0, 1.0)),
    "repetition_penalty": _nullable(_number(0.0, 2.0, low_open=True)),
    "min_tokens": _nullable(_integer(0, INT32_MAX)),
}
"""What `check_sampling` (gateway/api/schemas.py) refuses beyond the types."""
_WINDOW_PATTERN = (
    "^(?:(?:[1-9]|1[0-9]|2[0-4])h"
    "|(?:[1-9]|[1-9][0-9]|[1-9][0-9]{2}|1[0-3][0-9]{2}|14[0-3][0-9]|1440)m"
    "|(?:[6-9][0-9]|[1-9][0-9]{2,3}|[1-7][0-9]{4}|8[0-5][0-9]{3}|86[0-3][0-9]{2}|86400)s)$"
)
"""A whole number of hours, minutes or seconds from 1 min to 24 h (batches.parse_window)."""
_NAME = {"type": "string", "minLength": 1, "maxLength": 100, "pattern": "\\S"}
"""A tenant's name: 1 to 100 characters, not only spaces (admin.validate_tenant)."""


def _refuse(
    schema: dict[str, Any], refused: dict[str, Refused], *, declares_tools: bool = False
) -> None:
    """*schema* (an object's) refuses every property it does not list, and lists each of
    *refused* with only the values that ask for nothing (null and its `off` values):
    `check_parameters` answers anything else with 400 `unsupported_parameter`. With
    *declares_tools* (the served model's template declares tools) the tool fields keep their
    schemas: they are honoured."""
    schema["additionalProperties"] = False
    for name, rule in refused.items():
        if declares_tools and name in TOOL_FIELDS:
            continue
        reason = tool_refusal(declares_tools) if name in TOOL_PARAMETERS else rule.reason
        schema["properties"][name] = {
            "enum": [None, *rule.off],
            "description": f"not supported: {reason}",
        }


def _tighten(schemas: dict[str, Any], app: web.Application | None) -> None:
    """Adds to msgspec's *schemas* what the handlers check beyond the types (see the module
    doc); with *app*, also what depends on its model: its name and vocabulary."""
    declares_tools = app is not None and TOKENIZER in app and app[TOKENIZER].declares_tools
    for name, refused in (
        ("ChatCompletionRequest", REFUSED_CHAT),
        ("CompletionRequest", REFUSED_COMPLETIONS),
    ):
        _refuse(schemas[name], refused, declares_tools=declares_tools)
        props = schemas[name]["properties"]
        props.update(_SAMPLING)
        for no_op, why in NO_OP.items():
            props[no_op] = {**props[no_op], "description": f"accepted, no effect: {why}"}
        schemas[name]["allOf"] = [
            {  # a seed only with greedy decoding
                "if": {"properties": {"seed": {"type": "integer"}}, "required": ["seed"]},
                "then": {
                    "required": ["temperature"],
                    "properties": {"temperature": {"const": 0}},
                    "description": SEED_NEEDS_GREEDY,
                },
            }
        ]
        if app is not None:
            props["model"] = {"type": "string", "enum": [app[CONFIG].model.name]}
    chat = schemas["ChatCompletionRequest"]["properties"]
    chat["messages"]["minItems"] = 1
    _refuse(schemas["ChatMessage"], REFUSED_MESSAGE_FIELDS, declares_tools=declares_tools)
    _refuse(schemas["StreamOptions"], REFUSED_STREAM_OPTIONS)
    chat["max_completion_tokens"] = _nullable(_integer(1, INT32_MAX))
    chat["top_logprobs"] = _nullable(_integer(0, MAX_TOP_LOGPROBS_CHAT))
    schemas["ChatCompletionRequest"]["allOf"].append(
        {  # alternatives only with the log probabilities they go with
            "if": {
                "properties": {"top_logprobs": {"type": "integer"}},
                "required": ["top_logprobs"],
            },
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        }
    )
    schemas["CompletionRequest"]["properties"]["logprobs"] = _nullable(
        _integer(0, MAX_LOGPROBS_COMPLETIONS)
    )
    schemas["ResponseFormat"]["oneOf"] = [
        {
            "properties": {
                "type": {"enum": ["text", "json_object"]},
                "json_schema": {"type": "null"},
            }
        },
        {
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"not": {"type": "null"}},
            },
            "required": ["json_schema"],
        },
    ]
    schemas["JsonSchemaFormat"]["properties"]["name"] = {
        "type": "string",
        "pattern": SCHEMA_NAME_PATTERN.pattern,
    }
    schemas["ContentPart"]["properties"] = {
        "type": {"const": "text"},
        "text": {"type": "string"},
    }
    schemas["ContentPart"]["required"] = ["type", "text"]
    schemas["ContentPart"]["additionalProperties"] = False
    token_id: dict[str, Any] = {"type": "integer", "minimum": 0}
    token_ids: dict[str, Any] = {"type": "array", "items": token_id, "minItems": 1}
    if app is not None:
        token_id["maximum"] = app[TOKENIZER].vocab_size - 1
        token_ids["maxItems"] = app[TOKENIZER].context_len - 1
    completion = schemas["CompletionRequest"]["properties"]
    completion["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": 1,
            },
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1},
        ],
        "description": "text, a one-element list of text, token ids, or a one-element list of "
        "token ids; token ids are in [0, the model's vocab_size)",
    }
    completion["echo"] = {"type": "boolean", "const": False, "default": False}
    slo = schemas["SloIn"]
    for key in ("ttft_ms", "tpot_ms", "deadline_s"):
        slo["properties"][key] = _nullable(_number(0.0, low_open=True))
    slo["properties"]["weight"] = {**_number(0.0, low_open=True), "default": 1.0}
    slo["if"] = {"properties": {"allow_rt": {"const": True}}, "required": ["allow_rt"]}
    slo["then"] = _requires_targets({})
    quota = schemas["QuotaIn"]["properties"]
    for key, high in (
        ("requests_per_min", INT32_MAX),
        ("tokens_per_min", INT64_MAX),
        ("max_concurrent", INT32_MAX),
        ("monthly_tokens", INT64_MAX),
    ):
        quota[key] = {"anyOf": [_integer(0, high), {"type": "null"}]}
    create = schemas["TenantCreate"]
    create["properties"]["name"] = _NAME
    create["allOf"] = [
        {  # an rt tenant needs both targets
            "if": {"properties": {"tier": {"const": "rt"}}},
            "then": {"required": ["slo"], "properties": {"slo": _requires_targets({})}},
        },
        {  # what an unattainable RT request gets means nothing without RT requests
            "if": {"properties": {"slo": {"properties": {"on_unattainable": {"const": "reject"}}}}},
            "else": {
                "anyOf": [
                    {"properties": {"tier": {"const": "rt"}}},
                    {
                        "properties": {
                            "slo": {
                                "required": ["allow_rt"],
                                "properties": {"allow_rt": {"const": True}},
                            }
                        }
                    },
                ]
            },
        },
    ]
    schemas["TenantPatch"]["properties"]["name"] = _nullable(_NAME)
    schemas["KeyCreate"]["properties"]["name"] = _nullable({"type": "string", "maxLength": 200})
    batch = schemas["CreateBatchRequest"]["properties"]
    batch["endpoint"] = {"enum": sorted(ENDPOINTS)}
    batch["completion_window"] = {
        "type": "string",
        "pattern": _WINDOW_PATTERN,
        "description": "24h, or a shorter window of at least 1m: 1h, 30m, 90s (whole hours, "
        "minutes or seconds; the server also takes decimals, as in 1.5h)",
    }
    batch["metadata"] = _nullable(
        {
            "type": "object",
            "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": 64},
            "additionalProperties": {"type": "string", "maxLength": 512},
        }
    )


def document(app: web.Application | None = None) -> dict[str, Any]:
    """The OpenAPI document (of the operations *app* registers, or of all)."""
    served = registered(app) if app is not None else None
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=REF_TEMPLATE)
    _tighten(schemas, app)
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
                "scrapeToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "metrics.scrape_token (TANDEM_METRICS__SCRAPE_TOKEN)",
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


# ------------------------------------------------------------------ the operations

_STRING: dict[str, Any] = {"type": "string"}
_DATE_TIME: dict[str, Any] = {
    "type": "string",
    "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9]{2}(:[0-9]{2}(:[0-9]{2}([.][0-9]{1,6})?)?)?"
    "(Z|[+-][0-9]{2}:[0-9]{2})?)?$",
    "description": "ISO 8601: a date, or a date and time (UTC unless it has an offset)",
}
_USAGE_QUERY = [
    ("tenant", _STRING, "tenant id or name (default: all tenants)"),
    ("engine", _STRING, "only the requests one engine ran: its name in /readyz (default: all)"),
    (
        "start",
        _DATE_TIME,
        "ISO 8601 start (inclusive, UTC if no zone; default: 30 days / 24 hours before end)",
    ),
    ("end", _DATE_TIME, "ISO 8601 end (exclusive; default: now)"),
    ("group_by", {"enum": sorted(GROUP_BY_S)}, "day (default) or hour"),
    ("format", {"enum": ["csv", "json"]}, "json (default) or csv"),
]
_PAGE_QUERY = [
    ("limit", _integer(1, 100), "page size (default 20)"),
    ("after", _STRING, "cursor: the last id of the previous page"),
]
_GEN_ERRORS = (400, 401, 403, 404, 422, 429, 503)
_MODEL: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": _STRING,
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": _STRING,
        "max_model_len": {"type": "integer", "description": "the model's context, tokens"},
    },
}

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
        "Readiness: 200 when at least one engine serves and the database is at the "
        "newest migration, else 503",
        "operations",
        NONE,
        errors=(503,),
    ),
    Op(
        "GET",
        "/metrics",
        "Prometheus metrics (text format); with metrics.scrape_token set, only for a bearer "
        "of it or of the admin token",
        "operations",
        SCRAPE,
        response={"type": "string"},
        response_type="text/plain",
        errors=(401,),
    ),
    Op("GET", "/openapi.json", "This document", "operations", NONE, errors=()),
    # OpenAI-compatible
    Op(
        "GET",
        "/v1/models",
        "The served model",
        "openai",
        TENANT,
        response={
            "type": "object",
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
        },
        errors=(401,),
    ),
    Op(
        "GET",
        "/v1/models/{model}",
        "The served model's object; 404 model_not_found for any other id",
        "openai",
        TENANT,
        response=_MODEL,
        errors=(401, 404),
    ),
    Op(
        "POST",
        "/v1/chat/completions",
        "Chat completion (stream: true gives SSE chunks ending in "
        "data: [DONE]); another model than the served one: 404 model_not_found; over a "
        "quota: 429 with Retry-After, the error code names the limit; needing more tokens "
        "than the whole tokens_per_min (prompt + max_tokens, or the default cap): 400 "
        "request_too_large_for_limit; a tenant with a limit of 0: 403 <limit>_is_zero",
        "openai",
        TENANT,
        body="ChatCompletionRequest",
        other_responses=(_SSE,),
        errors=_GEN_ERRORS,
        success_headers=_RATE_LIMIT_HEADERS,
    ),
    Op(
        "POST",
        "/v1/completions",
        "Text completion (streaming as for chat)",
        "openai",
        TENANT,
        body="CompletionRequest",
        other_responses=(_SSE,),
        errors=_GEN_ERRORS,
        success_headers=_RATE_LIMIT_HEADERS,
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
    Op(
        "GET",
        "/v1/files",
        "The tenant's files",
        "batch",
        TENANT,
        query=[*_PAGE_QUERY, ("purpose", {"enum": list(FILE_PURPOSES)}, "only files of it")],
        errors=(400, 401),
    ),
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
        body="CreateBatchRequest",
        errors=(400, 401, 404, 422, 429),
    ),
    Op(
        "GET",
        "/v1/batches",
        "The tenant's batches, newest first",
        "batch",
        TENANT,
        query=_PAGE_QUERY,
    ),
    Op("GET", "/v1/batches/{batch_id}", "A batch", "batch", TENANT),
    Op(
        "POST",
        "/v1/batches/{batch_id}/cancel",
        "Cancel a batch (409 batch_not_cancellable once it has ended)",
        "batch",
        TENANT,
        errors=(400, 401, 404, 409, 422),
    ),
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
        "POST",
        "/admin/v1/batches/{batch_id}/cancel",
        "Cancel any tenant's batch (as the tenant's own cancel)",
        "admin",
        ADMIN,
        errors=(401, 404, 409),
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
        other_responses=(("text/csv", {"type": "string", "description": "with format=csv"}),),
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
            ("tenant", _STRING, "tenant id (default: all)"),
            ("engine", _STRING, "one engine's records: its name in /readyz (default: all)"),
            ("limit", _integer(1, 1000), "1-1000, default 100"),
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
        query=[("hours", _number(0.0, 72.0, low_open=True), "window, (0, 72], default 6")],
        errors=(400, 401),
    ),
]
