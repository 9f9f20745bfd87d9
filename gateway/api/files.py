"""The Files API (OpenAI-compatible): upload a batch input, read files back, delete them.

`POST /v1/files` (multipart: `purpose`=batch, `file`), `GET /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`. A tenant sees only its own files: another
tenant's id answers 404, exactly like an unknown one. Uploads are streamed and capped at
`batch.max_file_bytes` (413) and `batch.max_lines` lines (400), with the limit in the message.
"""

from __future__ import annotations

import zlib

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.api.body import payload_error
from gateway.api.disposition import attachment
from gateway.api.openai import authenticate
from gateway.batch.app import BATCH_STORE
from gateway.batch.types import FILE_PURPOSES, FileInfo
from gateway.errors import ApiError
from gateway.state import CONFIG

routes = web.RouteTableDef()

_MAX_FILENAME_CHARS = 255
_CHUNK_BYTES = 1 << 16
_MALFORMED_MULTIPART = (
    ValueError,  # boundaries, lengths, base64 and charsets (UnicodeDecodeError)
    LookupError,  # an unknown charset
    RuntimeError,  # an unknown Content-Encoding or Content-Transfer-Encoding of a part
    zlib.error,  # a part whose Content-Encoding (gzip, deflate) does not decode
    HttpProcessingError,  # a part with too many headers
    RuntimeWarning,  # a bad Content-Disposition: raised only where warnings are errors
)
"""What aiohttp's multipart reader raises on a body that is not valid multipart/form-data
(the client's error: a 400, not a 500)."""


def file_not_found(file_id: str) -> ApiError:
    """The 404 for an unknown (or someone else's) file."""
    return ApiError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


def list_params(request: web.Request) -> tuple[int, str | None]:
    """`limit` (1…100, default 20) and `after` of a list request; 400 naming a bad one."""
    raw = request.query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        raise ApiError(
            400, f"limit must be an integer, got {raw!r}", param="limit", code="invalid_value"
        ) from None
    if not 1 <= limit <= 100:
        raise ApiError(
            400,
            f"limit must be between 1 and 100, got {limit}",
            param="limit",
            code="invalid_value",
        )
    return limit, request.query.get("after") or None


def page(objects: list[dict[str, object]], has_more: bool) -> dict[str, object]:
    """OpenAI's list envelope."""
    return {
        "object": "list",
        "data": objects,
        "has_more": has_more,
        "first_id": objects[0]["id"] if objects else None,
        "last_id": objects[-1]["id"] if objects else None,
    }


@routes.post("/v1/files")
async def upload_file(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    limits = request.app[CONFIG].batch
    if (
        request.content_length is not None
        and request.content_length > limits.max_file_bytes + _CHUNK_BYTES
    ):
        raise _too_large(request.content_length, limits.max_file_bytes)
    if not request.content_type.startswith("multipart/"):
        raise ApiError(
            400,
            "upload the file as multipart/form-data with fields 'purpose' and 'file'",
            code="invalid_request",
        )
    try:
        purpose, filename, content = await _read_upload(request, limits.max_file_bytes)
    except web.RequestPayloadError:  # the body's Content-Encoding did not decode
        raise payload_error(request) from None
    except _MALFORMED_MULTIPART as exc:
        raise ApiError(
            400,
            f"the body is not valid multipart/form-data ({type(exc).__name__}: {exc}); send"
            " fields 'purpose' and 'file'",
            code="invalid_multipart",
        ) from None
    if purpose is None:
        raise ApiError(400, "missing field 'purpose'", param="purpose", code="missing_field")
    if purpose not in FILE_PURPOSES:
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported; use 'batch'",
            param="purpose",
            code="invalid_value",
        )
    if content is None or filename is None:
        raise ApiError(400, "missing field 'file'", param="file", code="missing_field")
    check_filename(filename)
    lines = _count_lines(content, limits.max_lines)
    info = await request.app[BATCH_STORE].create_file(
        principal.tenant.id, purpose, filename[:_MAX_FILENAME_CHARS], content, lines
    )
    return web.json_response(info.to_openai())


async def _read_upload(
    request: web.Request, max_bytes: int
) -> tuple[str | None, str | None, bytes | None]:
    purpose: str | None = None
    filename: str | None = None
    content: bytes | None = None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "purpose":
            purpose = (await part.read(decode=True)).decode("utf-8", "replace").strip()
        elif part.name == "file":
            filename = part.filename or "upload.jsonl"
            content = await _read_capped(part, max_bytes)
        else:
            await part.release()
    return purpose, filename, content


async def _read_capped(part: BodyPartReader, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(_CHUNK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def check_filename(filename: str) -> None:
    """400 naming `file` when the upload's file name holds a control character: a NUL cannot be
    stored (PostgreSQL refuses it), and a CR or LF would break the download's header."""
    bad = next((c for c in filename if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ApiError(
            400,
            f"the file name must not contain control characters, got {bad!r} in {filename!r}",
            param="file",
            code="invalid_filename",
        )


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"file is larger than the limit of {limit} bytes (got at least {size} "
        f"bytes); split it into several batches",
        param="file",
        code="file_too_large",
    )


def _count_lines(content: bytes, max_lines: int) -> int:
    """Non-empty lines of a JSONL upload; 400 when it is empty, not UTF-8, or too long."""
    if not content.strip():
        raise ApiError(400, "the file is empty", param="file", code="empty_file")
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"the file is not UTF-8 text (byte {exc.start})", param="file", code="invalid_file"
        ) from None
    lines = sum(1 for line in content.split(b"\n") if line.strip())
    if lines > max_lines:
        raise ApiError(
            400,
            f"the file has {lines} lines; a batch may have at most {max_lines}",
            param="file",
            code="too_many_lines",
        )
    return lines


async def _own_file(request: web.Request) -> FileInfo:
    principal = await authenticate(request)
    file_id = request.match_info["file_id"]
    info = await request.app[BATCH_STORE].get_file(principal.tenant.id, file_id)
    if info is None:
        raise file_not_found(file_id)
    return info


@routes.get("/v1/files")
async def list_files(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    limit, after = list_params(request)
    purpose = request.query.get("purpose") or None
    files, more = await request.app[BATCH_STORE].list_files(
        principal.tenant.id, purpose, limit, after
    )
    return web.json_response(page([f.to_openai() for f in files], more))


@routes.get("/v1/files/{file_id}")
async def get_file(request: web.Request) -> web.Response:
    return web.json_response((await _own_file(request)).to_openai())


@routes.get("/v1/files/{file_id}/content")
async def file_content(request: web.Request) -> web.Response:
    info = await _own_file(request)
    content = await request.app[BATCH_STORE].file_content(info.tenant_id, info.id)
    if content is None:
        raise file_not_found(info.id)
    return web.Response(
        body=content,
        content_type="application/octet-stream",
        headers={"Content-Disposition": attachment(info.filename)},
    )


@routes.delete("/v1/files/{file_id}")
async def delete_file(request: web.Request) -> web.Response:
    info = await _own_file(request)
    await request.app[BATCH_STORE].delete_file(info.tenant_id, info.id)
    return web.json_response({"id": info.id, "object": "file", "deleted": True})
