"""OpenAI-style errors: one exception type, one body shape, one middleware.

Every error a client sees has the body ``{"error": {"message", "type", "param", "code"}}``; no
stack trace ever reaches a client (unexpected exceptions are logged and answered with a generic
500; one that says the database is unreachable is a 503 `database_unavailable` with Retry-After,
logged once per outage: gateway/store/outage.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import msgspec
from aiohttp import web

from gateway.store.outage import DATABASE_OUTAGE

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error answered to the client with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def error_type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def to_response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ApiError:
    """422 naming the offending field from a msgspec validation message.

    msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`" or "Object missing required
    field `messages`"; the field becomes `param` and leads the message.
    """
    text = str(exc)
    param: str | None = None
    if " - at `$." in text:
        text, _, where = text.rpartition(" - at `$.")
        param = where.rstrip("`")
    elif "required field `" in text:
        param = text.split("required field `", 1)[1].split("`", 1)[0]
    elif "unknown field `" in text:
        param = text.split("unknown field `", 1)[1].split("`", 1)[0]
    message = f"{param}: {text}" if param else text
    return ApiError(422, message, param=param, code="invalid_value")


def _from_http_exception(exc: web.HTTPException) -> ApiError:
    if exc.status == 413:
        return ApiError(413, "request body too large", code="request_too_large")
    if exc.status == 404:
        return ApiError(404, "unknown route", code="unknown_route")
    if exc.status == 405:
        # RFC 9110: a 405 must list the route's methods in Allow (aiohttp's exception has it)
        allow = exc.headers.get("Allow", "")
        return ApiError(
            405,
            f"method not allowed on this route (allowed: {allow.replace(',', ', ')})",
            code="method_not_allowed",
            headers={"Allow": allow},
        )
    return ApiError(exc.status, exc.reason or "request failed")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns every failure into an OpenAI error body; hides internals."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http_exception(exc).to_response()
    except Exception as exc:
        outage = request.app.get(DATABASE_OUTAGE)
        if outage is not None and outage.report(exc, f"{request.method} {request.path}"):
            return database_unavailable(outage.retry_after_s).to_response()  # logged once
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error", code="internal_error").to_response()


def database_unavailable(retry_after_s: int) -> ApiError:
    """The 503 of a request that failed because the database is unreachable (transient: the
    client may retry after *retry_after_s*)."""
    return ApiError(
        503,
        f"the database is unavailable; retry in {retry_after_s} s",
        code="database_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )
