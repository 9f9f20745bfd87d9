"""The Batch API (OpenAI-compatible): create, read, list and cancel batches.

`POST /v1/batches` `{"input_file_id", "endpoint", "completion_window", "metadata"}` →
the batch object in status `validating`; the runner (gateway/batch/runner.py) takes it from
there. `completion_window` is "24h" as in OpenAI, or — tandem's extension — a shorter window
such as "1h" or "30m": the window is then the batch's deadline, passed to the engine with every
line so its scheduler can rush them. A tenant's BE contract deadline (`deadline_s`) counts from
the batch's creation too; the earlier of the two wins. A batch not done by its window expires.
"""

from __future__ import annotations

import re
from datetime import timedelta

import msgspec
from aiohttp import web

from gateway.api.files import file_not_found, list_params, page
from gateway.api.openai import authenticate
from gateway.api.schemas import check_text, decode_body
from gateway.batch.app import BATCH_STORE, wake_runner
from gateway.batch.lines import now_utc
from gateway.batch.types import ENDPOINTS, BatchInfo
from gateway.errors import ApiError
from gateway.state import CONFIG

routes = web.RouteTableDef()

MAX_WINDOW = timedelta(hours=24)
MIN_WINDOW = timedelta(minutes=1)
_WINDOW = re.compile(r"^(\d+(?:\.\d+)?)([hms])$")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}
MAX_WINDOW_CHARS = 16
"""Longest `completion_window` text, characters (the batches column's size)."""
MAX_METADATA_PAIRS = 16


class CreateBatchRequest(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def parse_window(text: str) -> timedelta:
    """ "24h", "90m", "3600s" → a timedelta within [1 min, 24 h]; 400 naming the field. The text
    is stored as sent, so it is at most MAX_WINDOW_CHARS long (the column's size)."""
    match = _WINDOW.fullmatch(text.strip()) if len(text) <= MAX_WINDOW_CHARS else None
    if match is None:
        raise ApiError(
            400,
            f"completion_window must look like '24h' (or a shorter window such "
            f"as '1h' or '30m'), got {_shown(text)}",
            param="completion_window",
            code="invalid_value",
        )
    # compared in seconds first: "9999999999999h" is past what a timedelta can hold
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if not MIN_WINDOW.total_seconds() <= seconds <= MAX_WINDOW.total_seconds():
        raise ApiError(
            400,
            f"completion_window must be between 1m and 24h, got {_shown(text)}",
            param="completion_window",
            code="invalid_value",
        )
    return timedelta(seconds=seconds)


def _shown(text: str) -> str:
    """*text* quoted for an error message, cut at MAX_WINDOW_CHARS characters."""
    return repr(text) if len(text) <= MAX_WINDOW_CHARS else f"{text[:MAX_WINDOW_CHARS]!r}..."


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ApiError(
            400,
            f"metadata may have at most {MAX_METADATA_PAIRS} pairs",
            param="metadata",
            code="invalid_value",
        )
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError(
                400,
                "metadata keys are at most 64 and values at most 512 characters",
                param="metadata",
                code="invalid_value",
            )


def batch_not_found(batch_id: str) -> ApiError:
    """The 404 for an unknown (or someone else's) batch."""
    return ApiError(
        404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found"
    )


@routes.post("/v1/batches")
async def create_batch(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    body = decode_body(await request.read(), CreateBatchRequest)
    assert isinstance(body, CreateBatchRequest)
    check_text("input_file_id", body.input_file_id)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
            param="endpoint",
            code="invalid_value",
        )
    window = parse_window(body.completion_window)
    _check_metadata(body.metadata)
    store = request.app[BATCH_STORE]
    tenant = principal.tenant
    info = await store.get_file(tenant.id, body.input_file_id)
    if info is None:
        raise file_not_found(body.input_file_id)
    if info.purpose != "batch":
        raise ApiError(
            400,
            f"file {info.id} has purpose {info.purpose!r}; a batch input must "
            f"be uploaded with purpose 'batch'",
            param="input_file_id",
            code="invalid_value",
        )
    max_lines = request.app[CONFIG].batch.max_lines
    if info.line_count is not None and info.line_count > max_lines:
        raise ApiError(
            400,
            f"file {info.id} has {info.line_count} lines; a batch may have at most {max_lines}",
            param="input_file_id",
            code="too_many_lines",
        )
    created = now_utc()
    deadlines = []
    if window < MAX_WINDOW:
        deadlines.append(created + window)
    if tenant.slo.deadline_s is not None:
        deadlines.append(created + timedelta(seconds=tenant.slo.deadline_s))
    batch = await store.create_batch(
        tenant_id=tenant.id,
        key_id=principal.key_id or None,
        input_file_id=info.id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        window=window,
        deadline_at=min(deadlines) if deadlines else None,
        metadata=body.metadata,
        request_total=info.line_count or 0,
    )
    wake_runner(request.app)
    return web.json_response(batch.to_openai())


async def _own_batch(request: web.Request) -> BatchInfo:
    principal = await authenticate(request)
    batch_id = request.match_info["batch_id"]
    batch = await request.app[BATCH_STORE].get_batch(batch_id, principal.tenant.id)
    if batch is None:
        raise batch_not_found(batch_id)
    return batch


@routes.get("/v1/batches/{batch_id}")
async def get_batch(request: web.Request) -> web.Response:
    return web.json_response((await _own_batch(request)).to_openai())


@routes.get("/v1/batches")
async def list_batches(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    limit, after = list_params(request)
    batches, more = await request.app[BATCH_STORE].list_batches(principal.tenant.id, limit, after)
    return web.json_response(page([b.to_openai() for b in batches], more))


@routes.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: web.Request) -> web.Response:
    batch = await _own_batch(request)
    return web.json_response((await cancel(request.app, batch)).to_openai())


async def cancel(app: web.Application, batch: BatchInfo) -> BatchInfo:
    """Cancels *batch* (the tenant's own cancel and the admin's): `cancelling` now, and the
    runner winds it down (running lines stopped, the rest `batch_cancelled` in the error file).
    Cancelling a batch already `cancelling` is a no-op; one that has ended is a 409. Returns the
    batch as it is now."""
    store = app[BATCH_STORE]
    if batch.status in ("validating", "in_progress"):
        await store.set_status(batch.id, "cancelling", expect=("validating", "in_progress"))
        wake_runner(app)
    elif batch.status != "cancelling":
        raise ApiError(
            409,
            f"batch {batch.id} is {batch.status} and can no longer be cancelled",
            param="batch_id",
            code="batch_not_cancellable",
        )
    updated = await store.get_batch(batch.id, batch.tenant_id)
    assert updated is not None
    return updated
