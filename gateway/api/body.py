"""Guards on what every request carries before a handler reads it: its URL and its body's
Content-Encoding. Each turns input no handler can use into a 400 with an OpenAI error body,
where it would otherwise surface deep inside a handler as a 500 (issue 16).

* A NUL character in the path or the query string (``%00``): no id, name or parameter has one,
  and PostgreSQL refuses it in any text it is asked to compare, so the lookup would fail.
* A body whose Content-Encoding it does not decode as (``gzip`` that is not gzip): aiohttp
  decompresses while the handler reads, and raises `RequestPayloadError` there. The body is
  read here, first, so the client gets a 400 naming the encoding and no handler sees the error.
  A multipart body (a file upload) is left to its handler, which streams it under its own size
  limit and names a bad encoding itself (gateway/api/files.py).
"""

from __future__ import annotations

from aiohttp import web

from gateway.errors import ApiError, Handler


def payload_error(request: web.Request) -> ApiError:
    """The 400 for a body that could not be read as sent (aiohttp raised `RequestPayloadError`
    while reading it)."""
    encoding = request.headers.get("Content-Encoding")
    if encoding:
        message = f"request body is not valid for its Content-Encoding {encoding!r}"
    else:
        message = "request body could not be read as sent"
    return ApiError(400, message, code="invalid_body_encoding")


@web.middleware
async def body_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses a URL with a NUL and a body its Content-Encoding does not decode (module
    docstring); then runs the handler."""
    if "\x00" in request.path or "\x00" in request.query_string:
        raise ApiError(
            400,
            "the URL must not contain a NUL character (%00)",
            param="url",
            code="invalid_url",
        )
    if (
        request.can_read_body
        and request.headers.get("Content-Encoding")
        and not request.content_type.startswith("multipart/")
    ):
        try:
            await request.read()  # cached: the handler's read() returns the same bytes
        except web.RequestPayloadError:
            raise payload_error(request) from None
    return await handler(request)
