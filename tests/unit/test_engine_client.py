"""Turning SGLang's cumulative stream into deltas; telling an engine that never took a request
from one that went away with it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.engine.client import EngineClient, EngineUnavailable, _GenerateOut, _to_chunk


def out(text: str, finish: Any = None, tokens: int = 1, **meta: Any) -> _GenerateOut:
    return _GenerateOut(
        text=text,
        meta_info={
            "finish_reason": finish,
            "prompt_tokens": 5,
            "completion_tokens": tokens,
            **meta,
        },
    )


def replay(updates: list[_GenerateOut]) -> list[str]:
    emitted, deltas = 0, []
    for update in updates:
        chunk = _to_chunk(update, emitted)
        emitted += len(chunk.text_delta)
        deltas.append(chunk.text_delta)
    return deltas


def test_cumulative_text_becomes_deltas() -> None:
    assert replay([out("He"), out("Hello"), out("Hello!", {"type": "length"})]) == [
        "He",
        "llo",
        "!",
    ]


def test_half_a_character_is_held_back_until_completed() -> None:
    deltas = replay([out("caf"), out("caf\ufffd"), out("café"), out("café!", {"type": "stop"})])
    assert deltas == ["caf", "", "é", "!"]
    assert "\ufffd" not in "".join(deltas)


def test_last_chunk_carries_finish_and_counts() -> None:
    chunk = _to_chunk(
        out(
            "x",
            {"type": "stop", "matched": "\n"},
            tokens=3,
            queue_time=0.25,
            cached_tokens=2,
            num_retractions=1,
        ),
        0,
    )
    assert chunk.finish_reason == "stop" and chunk.matched_stop == "\n"
    assert chunk.completion_tokens == 3 and chunk.prompt_tokens == 5
    assert chunk.queue_time_s == 0.25 and chunk.cached_tokens == 2 and chunk.num_retractions == 1


@asynccontextmanager
async def engine_answering(handler: Any) -> AsyncIterator[str]:
    """The base URL of an in-process engine whose `/generate` is *handler*."""
    app = web.Application()
    app.router.add_post("/generate", handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def unavailable(base_url: str) -> EngineUnavailable:
    async with aiohttp.ClientSession() as session:
        client = EngineClient(base_url, session, timeout_s=5.0)
        with pytest.raises(EngineUnavailable) as caught:
            async for _ in client.generate({"rid": "r1", "text": "hi"}, stream=False):
                pass
        return caught.value


async def test_an_engine_that_refuses_the_connection_never_had_the_request() -> None:
    with socket.socket() as sock:  # bound, never listening: connection refused
        sock.bind(("127.0.0.1", 0))
        error = await unavailable(f"http://127.0.0.1:{sock.getsockname()[1]}")
    assert not error.is_lost


async def test_an_engine_that_drops_the_connection_was_lost_with_the_request() -> None:
    async def crash(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        request.transport.abort()  # as when the engine process dies mid-request
        return web.Response()

    async with engine_answering(crash) as url:
        assert (await unavailable(url)).is_lost


@pytest.mark.parametrize(("status", "is_lost"), [(503, False), (429, False), (500, True)])
async def test_capacity_answers_never_took_the_request_other_server_errors_may_have(
    status: int, is_lost: bool
) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status)

    async with engine_answering(answer) as url:
        assert (await unavailable(url)).is_lost is is_lost


async def test_finished_streams_hand_their_connection_back_for_the_next_request() -> None:
    """A stream ends at `data: [DONE]`; the rest of its body (the chunked terminator) is read so
    the connection is reused: left unread, every request paid for a new connection."""
    connections: set[int] = set()

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        connections.add(id(request.transport))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        done = {"type": "length"}
        await resp.write(b"data: " + msgspec.json.encode(out("hi", done)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.01)  # the terminator comes after [DONE] has been read, as SGLang's
        await resp.write_eof()
        return resp

    async with engine_answering(stream) as url, aiohttp.ClientSession() as session:
        client = EngineClient(url, session, timeout_s=5.0)
        for i in range(10):
            chunks = [c async for c in client.generate({"rid": f"r{i}", "text": "hi"})]
            assert chunks[-1].finish_reason == "length"
    assert len(connections) == 1


async def test_a_data_parallel_ranks_client_routes_every_request_to_its_rank() -> None:
    bodies: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.Response(body=msgspec.json.encode(out("hi", {"type": "length"})))

    async with engine_answering(answer) as url, aiohttp.ClientSession() as session:
        for client in (EngineClient(url, session, 5.0, dp_rank=1), EngineClient(url, session, 5.0)):
            async for _ in client.generate({"rid": "r", "text": "hi"}, stream=False):
                pass
    assert bodies[0]["routed_dp_rank"] == 1  # SGLang's DP controller sends it to rank 1
    assert "routed_dp_rank" not in bodies[1]  # an engine placed whole: SGLang picks the rank


def test_cumulative_logprobs_become_the_new_tokens_of_each_chunk() -> None:
    # SGLang's shape (return_logprob, top_logprobs_num=2, return_text_in_logprobs), as the CPU
    # engine streams it: every update repeats the earlier tokens
    first = [[-0.5, 11, "Hel"]]
    both = [[-0.5, 11, "Hel"], [-1.25, 12, "lo"]]
    tops = [[[-0.5, 11, "Hel"], [-2.0, 13, "Hi"]], [[-1.25, 12, "lo"], [-1.5, 14, "p"]]]
    a = _to_chunk(out("Hel", output_token_logprobs=first, output_top_logprobs=tops[:1]), 0, 0)
    b = _to_chunk(
        out("Hello", {"type": "length"}, 2, output_token_logprobs=both, output_top_logprobs=tops),
        3,
        1,
    )
    assert [t.token for t in a.logprobs] == ["Hel"]
    assert [(t.token, t.logprob) for t in b.logprobs] == [("lo", -1.25)]
    assert [(alt.token, alt.logprob) for alt in b.logprobs[0].top] == [("lo", -1.25), ("p", -1.5)]
    assert _to_chunk(out("x"), 0, 0).logprobs == []  # not asked for: none


def test_an_engine_abort_that_rejects_the_request_is_a_400_with_its_reason() -> None:
    from gateway.pipeline.stages import OPERATOR_ABORT_MESSAGE, _abort_failure

    def abort(message: str, status: int | None) -> Any:
        finish = {"type": "abort", "message": message, "status_code": status}
        return _abort_failure(_to_chunk(out("", finish), 0))

    bad_grammar = abort("Failed to compile json_schema grammar: bad type", 400)
    assert (bad_grammar.http_status, bad_grammar.code) == (400, "engine_error")
    assert "Failed to compile json_schema grammar" in bad_grammar.message
    for message, status in ((OPERATOR_ABORT_MESSAGE, 400), ("evicted", None), ("oom", 500)):
        assert abort(message, status).code == "engine_aborted"  # not the request's fault: retry
