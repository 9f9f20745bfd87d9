"""The request id every response carries in `x-request-id` (as OpenAI's API does).

The id is the gateway's own, made when a response needs it: `tdm-` and 32 hex digits
(`new_rid`). For a generation it is also the engine request's `rid` and the usage record's
`request_id`, and the response body's `id` is it behind the endpoint's prefix (`chatcmpl-tdm-…`,
`cmpl-tdm-…`: gateway/api/render.py), so a client's response, the usage record and the engine's
logs join on one value — refused requests included (their usage record has the same id).

A client's own `X-Request-Id` is not adopted: the id is the engine's `rid`, which the engine
aborts by prefix and the usage table keys on, so an id a client chose could collide with (or
abort) another tenant's request. The response says the gateway's id only.
"""

from __future__ import annotations

from aiohttp import web

from gateway.pipeline.prepare import new_rid

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = web.RequestKey("request_id", str)
"""Where the request's id is kept on the aiohttp request (made on first use)."""


def request_id_of(request: web.Request) -> str:
    """The gateway's id of *request* (the same on every call for one request)."""
    rid = request.get(_REQUEST_ID)
    if rid is None:
        rid = request[_REQUEST_ID] = new_rid()
    return rid


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every response — JSON or server-sent events, success or error,
    from a handler or a middleware — gets its request's id before its headers go out."""
    response.headers[REQUEST_ID_HEADER] = request_id_of(request)
