"""The OpenAI-compatible public API: /v1/models (and /v1/models/{model}), /v1/chat/completions,
/v1/completions.

The handlers are the HTTP framing around the request pipeline (gateway/pipeline/stages.py):
they read the body, run parse → prepare → admit → place → run → record, and answer with one JSON
body or a stream of server-sent events, rendered by gateway/api/render.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
from aiohttp import web

from gateway.api.render import ResponseHead, StreamRenderer, completion_body, usage_body
from gateway.api.schemas import Endpoint, StreamOptions
from gateway.auth import Principal, bearer_token
from gateway.engine.client import EngineChunk
from gateway.overload import arrival_of
from gateway.pipeline.outcome import Refused, gateway_shut_down, internal_error
from gateway.pipeline.prepare import check_model, prepare_prompt_off_loop
from gateway.pipeline.stages import (
    Completion,
    Flight,
    Progress,
    admit_rechecking,
    complete,
    is_cancellation,
    parse,
    place,
    prepare,
    recording,
    response_headers,
    run,
)
from gateway.request_id import request_id_of
from gateway.slo import RequestTimer
from gateway.state import AUTH, CONFIG, DRAIN, TOKENIZER

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
_encoder = msgspec.json.Encoder()


async def authenticate(request: web.Request) -> Principal:
    return await request.app[AUTH].authenticate(bearer_token(request))


def model_object(app: web.Application) -> dict[str, Any]:
    """OpenAI's model object of the served model (the one /v1/models lists)."""
    return {
        "id": app[CONFIG].model.name,
        "object": "model",
        "created": 0,
        "owned_by": "tandem",
        "max_model_len": app[TOKENIZER].context_len,
    }


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    await authenticate(request)
    return web.json_response({"object": "list", "data": [model_object(request.app)]})


@routes.get("/v1/models/{model:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    """The model object of the served model; 404 `model_not_found` for any other id (the
    id may contain slashes, as Hugging Face names do)."""
    await authenticate(request)
    check_model(request.match_info["model"], request.app[CONFIG].model.name)
    return web.json_response(model_object(request.app))


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions")


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    arrival = arrival_of(request)  # before authentication: its time counts too
    principal = await authenticate(request)
    app = request.app
    flight = Flight(
        principal=principal,
        origin="api",
        endpoint=endpoint,
        model=app[CONFIG].model.name,
        request_id=request_id_of(request),  # the x-request-id of its response
        # from when its bytes reached the host, not when the gateway got to them
        timer=RequestTimer(start_s=arrival.monotonic_s),
        arrival_unix_s=arrival.unix_s,
    )
    with recording(app, flight):
        try:
            body = parse(app, flight, await request.read())
            # a long prompt is tokenized off the event loop (gateway/pipeline/prepare.py)
            gateway_config = app[CONFIG].gateway
            prompt = await prepare_prompt_off_loop(
                body, app[TOKENIZER], gateway_config.default_max_tokens
            )
            prepare(app, flight, body, prompt)
            if body.stream:
                return await _stream(request, flight, body.stream_options or StreamOptions())
            return await _respond(app, flight)
        except asyncio.CancelledError:
            if not _ended_by_the_drain(app, flight):
                raise  # the client went away
            # before any answer went out: a 503 to retry, recorded as such
            assert flight.failure is not None
            raise flight.failure.api_error() from None


def _ended_by_the_drain(app: web.Application, flight: Flight) -> bool:
    """For a handler getting a cancellation: whether the stopping gateway's drain ended the
    request (gateway/shutdown.py) rather than its client going away. If so, the cancellation is
    taken back and the request failed with `gateway_shut_down`, for the handler to answer."""
    if not app[DRAIN].was_cut():
        return False
    task = asyncio.current_task()
    assert task is not None
    task.uncancel()
    flight.fail(gateway_shut_down(ended=True))
    return True


async def _respond(app: web.Application, flight: Flight) -> web.Response:
    """The whole answer as one JSON body (or the error that ended the request)."""
    result = await complete(app, flight)
    if not isinstance(result, Completion):
        raise result.api_error()
    usage = usage_body(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
    body = completion_body(_head(flight), result.text, result.finish_reason, usage, result.logprobs)
    return web.json_response(body=_encoder.encode(body), headers=response_headers(app, flight))


async def _stream(
    request: web.Request, flight: Flight, options: StreamOptions
) -> web.StreamResponse:
    """The answer as server-sent events. A failure before the first chunk is an HTTP error; once
    the headers are out, it is reported in-band, as OpenAI does."""
    app = request.app
    admission = await admit_rechecking(app, flight)
    if isinstance(admission, Refused):
        raise admission.api_error()
    place(app, flight)
    render = StreamRenderer(_head(flight))
    async with contextlib.aclosing(run(app, flight)) as chunks:
        first = await anext(chunks, None)  # engine failures surface here, before any header
        if first is None:
            assert flight.failure is not None  # the run ended without a single chunk
            raise flight.failure.api_error()
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **response_headers(app, flight),
            }
        )
        await resp.prepare(request)
        try:
            await _send_chunk(resp, render, first, flight.progress, options)
            async for chunk in chunks:
                await _send_chunk(resp, render, chunk, flight.progress, options)
        except asyncio.CancelledError:
            if not _ended_by_the_drain(app, flight):
                raise  # the client went away: nobody to tell
            # the error event below tells the client
        except Exception as exc:
            if is_cancellation(exc):  # the client went away: nobody to tell
                raise
            # The headers are out: an error response now would be written into the stream
            # (a second status line the client cannot read). The stream ends in-band instead.
            log.exception("stream %s failed", flight.request and flight.request.rid)
            flight.fail(internal_error())
    if flight.failure is not None:
        await _send(resp, flight.failure.api_error().body())
    elif options.include_usage:
        await _send(resp, dict(render.chunk(None), usage=_usage(flight.progress)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _send_chunk(
    resp: web.StreamResponse,
    render: StreamRenderer,
    chunk: EngineChunk,
    progress: Progress,
    options: StreamOptions,
) -> None:
    for payload in render.events(chunk, every_step=options.continuous_usage_stats):
        if options.continuous_usage_stats:
            payload["usage"] = _usage(progress)
        await _send(resp, payload)


async def _send(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
    await resp.write(b"data: " + _encoder.encode(payload) + b"\n\n")


def _head(flight: Flight) -> ResponseHead:
    """What the response's bodies share; its id names the admitted request's engine rid."""
    assert flight.request is not None
    return ResponseHead(
        endpoint=flight.endpoint,
        rid=flight.request.rid,
        model=flight.model,
        logprobs=flight.request.asks_logprobs,
        tool_plan=flight.request.tool_plan,
    )


def _usage(progress: Progress) -> dict[str, Any]:
    return usage_body(progress.prompt_tokens, progress.completion_tokens, progress.cached_tokens)
