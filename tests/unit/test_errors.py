"""Error mapping: every failure is an OpenAI error body; nothing internal leaks."""

from __future__ import annotations

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.api.schemas import (
    ChatCompletionRequest,
    check_sampling,
    decode_body,
    decode_request,
)
from gateway.errors import ApiError, error_middleware


class Body(msgspec.Struct):
    max_tokens: int


def test_validation_error_names_the_field() -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(b'{"max_tokens": "ten"}', type=Body)
    from gateway.errors import validation_error

    err = validation_error(info.value)
    assert err.status == 422 and err.param == "max_tokens"
    assert err.body()["error"]["message"].startswith("max_tokens:")


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"", 400, None),
        (b"{not json", 400, None),
        (b'{"model": "m"}', 422, "messages"),
        (b'{"model": "m", "messages": [], "max_tokens": "x"}', 422, "max_tokens"),
        (
            b'{"model": "m", "messages": [{"role": "robot", "content": "hi"}]}',
            422,
            "messages[0].role",
        ),
        (b'{"model": "m", "messages": [], "stream": "yes"}', 422, "stream"),
        (b'{"model": "m", "messages": [], "ignore_eos": 3}', 422, "ignore_eos"),
    ],
)
def test_bad_bodies(raw: bytes, status: int, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(raw, ChatCompletionRequest)
    assert info.value.status == status
    assert info.value.param == param


def test_unknown_fields_are_refused_like_openai_does() -> None:
    # OpenAI answers an unrecognized argument with a 400; ignoring it would pretend to honour it
    with pytest.raises(ApiError) as info:
        decode_request(b'{"model": "m", "messages": [], "some_client_field": 1}', "chat")
    assert info.value.status == 400 and info.value.code == "unsupported_parameter"
    assert info.value.param == "some_client_field"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 3.0), ("top_p", 0.0), ("n", 2), ("max_tokens", 0), ("stop", ["a"] * 5)],
)
def test_range_checks_name_the_field(field: str, value: object) -> None:
    body = msgspec.convert({"model": "m", "messages": [], field: value}, ChatCompletionRequest)
    with pytest.raises(ApiError) as info:
        check_sampling(body)
    assert info.value.status == 400 and info.value.param == field


async def test_middleware_hides_internal_errors_and_maps_http_errors() -> None:
    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals /etc/passwd")

    async def refused(request: web.Request) -> web.Response:
        raise ApiError(429, "slow down", code="rate_limited", headers={"Retry-After": "3"})

    app = web.Application(middlewares=[error_middleware], client_max_size=10)
    app.router.add_get("/boom", boom)
    app.router.add_get("/refused", refused)
    app.router.add_post("/echo", _echo)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/boom")
        body = await resp.json()
        assert resp.status == 500 and "secret" not in await resp.text()
        assert body["error"]["type"] == "server_error"
        resp = await client.get("/refused")
        assert resp.status == 429 and resp.headers["Retry-After"] == "3"
        assert (await resp.json())["error"]["code"] == "rate_limited"
        resp = await client.get("/nowhere")
        assert resp.status == 404 and "error" in await resp.json()
        resp = await client.post("/echo", data=b"x" * 100)
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())
