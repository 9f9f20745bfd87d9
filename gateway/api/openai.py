"""The OpenAI-compatible public API: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from gateway.api.generation import Generation, is_cancellation
from gateway.api.prepare import (
    build_engine_request,
    chat_prompt_ids,
    completion_prompt_ids,
    output_cap,
    resolve_tier,
)
from gateway.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    StreamOptions,
    check_sampling,
    decode_body,
)
from gateway.auth import Principal, bearer_token
from gateway.engine.client import EngineChunk
from gateway.errors import ApiError
from gateway.state import AUTH, CONFIG, TOKENIZER

routes = web.RouteTableDef()
_encoder = msgspec.json.Encoder()


async def authenticate(request: web.Request) -> Principal:
    return await request.app[AUTH].authenticate(bearer_token(request))


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    await authenticate(request)
    config = request.app[CONFIG]
    model = {
        "id": config.model.name,
        "object": "model",
        "created": 0,
        "owned_by": "tandem",
        "max_model_len": request.app[TOKENIZER].context_len,
    }
    return web.json_response({"object": "list", "data": [model]})


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def _serve(request: web.Request, endpoint: str) -> web.StreamResponse:
    principal = await authenticate(request)
    app = request.app
    gen = Generation(
        app=app, principal=principal, endpoint=endpoint, model=app[CONFIG].model.name, stream=False
    )
    cancelled = False
    try:
        body = await _prepare(request, gen, endpoint)
        gen.stream = body.stream
        render = _chat_renderer(gen) if endpoint == "chat" else _completion_renderer(gen)
        if body.stream:
            options = body.stream_options or StreamOptions()
            return await _stream(request, gen, render, options)
        return await _collect(gen, render)
    except ApiError as exc:
        if gen.request is None:
            gen.reject(exc)
        raise
    except BaseException as exc:
        cancelled = is_cancellation(exc)
        raise
    finally:
        gen.close(cancelled=cancelled)


async def _prepare(request: web.Request, gen: Generation, endpoint: str) -> SamplingFields:
    app = request.app
    tokenizer = app[TOKENIZER]
    raw = await request.read()
    if endpoint == "chat":
        chat = decode_body(raw, ChatCompletionRequest)
        assert isinstance(chat, ChatCompletionRequest)
        body: SamplingFields = chat
        requested = chat.max_completion_tokens or chat.max_tokens
    else:
        body = decode_body(raw, CompletionRequest)  # type: ignore[assignment]
        requested = body.max_tokens
    check_sampling(body)
    _check_model(body.model, app[CONFIG].model.name)
    if isinstance(body, ChatCompletionRequest):
        input_ids = chat_prompt_ids(body, tokenizer)
    else:
        assert isinstance(body, CompletionRequest)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        input_ids = completion_prompt_ids(body, tokenizer)
    max_tokens = output_cap(
        body,
        requested,
        len(input_ids),
        tokenizer.context_len,
        app[CONFIG].gateway.default_max_tokens,
    )
    tier = resolve_tier(gen.principal.tenant, body.tier)
    gen.request = build_engine_request(body, input_ids, max_tokens, gen.principal, tier)
    return body


def _check_model(model: str, served: str) -> None:
    if model != served:
        raise ApiError(
            400,
            f"model {model!r} does not exist; this gateway serves {served!r}",
            param="model",
            code="model_not_found",
        )


Renderer = Callable[[EngineChunk | None, bool], dict[str, Any]]


def _chat_renderer(gen: Generation) -> Renderer:
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    first = [True]

    def render(chunk: EngineChunk | None, final: bool) -> dict[str, Any]:
        if final:  # non-streaming: one message with the whole text (`chunk` carries it)
            assert chunk is not None
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": chunk.text_delta},
                "finish_reason": _finish(chunk),
                "logprobs": None,
            }
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": gen.model,
                "choices": [choice],
                "usage": _usage(gen),
            }
        choices = []
        if chunk is not None:
            delta: dict[str, Any] = {"content": chunk.text_delta}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            choices.append(
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish(chunk)}
            )
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": gen.model,
            "choices": choices,
        }

    return render


def _completion_renderer(gen: Generation) -> Renderer:
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def render(chunk: EngineChunk | None, final: bool) -> dict[str, Any]:
        choices = []
        if chunk is not None:
            choices.append(
                {
                    "index": 0,
                    "text": chunk.text_delta,
                    "logprobs": None,
                    "finish_reason": _finish(chunk),
                }
            )
        out: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": gen.model,
            "choices": choices,
        }
        if final:
            out["usage"] = _usage(gen)
        return out

    return render


async def _collect(gen: Generation, render: Renderer) -> web.Response:
    parts: list[str] = []
    last: EngineChunk | None = None
    async for chunk in gen.chunks():
        parts.append(chunk.text_delta)
        last = chunk
    _raise_if_aborted(gen)
    assert last is not None
    whole = msgspec.structs.replace(last, text_delta="".join(parts))
    return web.json_response(body=_encoder.encode(render(whole, True)))


async def _stream(
    request: web.Request, gen: Generation, render: Renderer, options: StreamOptions
) -> web.StreamResponse:
    chunks = gen.chunks()
    first = await anext(chunks)  # engine failures surface here, before any header is sent
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    try:
        async for chunk in _prepend(first, chunks):
            if chunk.text_delta or chunk.finish_reason is not None:
                payload = render(chunk, False)
                if options.continuous_usage_stats:
                    payload["usage"] = _usage(gen)
                await _send(resp, payload)
        _raise_if_aborted(gen)
        if options.include_usage:
            await _send(resp, dict(render(None, False), usage=_usage(gen)))
    except ApiError as exc:  # headers are out: report in-band, as OpenAI does
        await _send(resp, exc.body())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _prepend(
    first: EngineChunk, rest: AsyncIterator[EngineChunk]
) -> AsyncIterator[EngineChunk]:
    yield first
    async for chunk in rest:
        yield chunk


async def _send(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
    await resp.write(b"data: " + _encoder.encode(payload) + b"\n\n")


def _raise_if_aborted(gen: Generation) -> None:
    if gen.outcome.status == "aborted":
        raise ApiError(
            503,
            "the engine aborted the request; retry later",
            code="engine_aborted",
            headers={"Retry-After": "1"},
        )


def _finish(chunk: EngineChunk) -> str | None:
    if chunk.finish_reason in (None, "abort"):
        return None
    return "length" if chunk.finish_reason == "length" else "stop"


def _usage(gen: Generation) -> dict[str, int]:
    o = gen.outcome
    return {
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    }
