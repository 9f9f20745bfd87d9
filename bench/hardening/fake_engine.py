"""A fake engine that answers at once: the gateway's own cost, measured without an engine's.

It serves the subset of SGLang's native API the gateway uses (`POST /generate` streaming and not,
`/abort_request`, `/health`, `/model_info`) and tandem's `GET /load` long poll (an idle engine
whose iteration counter ticks every `TICK_S`, as a real one reports after every iteration), and
— for the direct path the gateway's added latency is measured against — `POST
/v1/chat/completions` answering the same number of tokens as OpenAI chunks. Every answer is
written as soon as the request is read: `max_new_tokens` (`max_tokens`) tokens of one word each,
in one SSE event per token when streamed.

    python -m bench.hardening fake-engine --port 30000
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from aiohttp import web

from common.wire import CONTROL_LOAD_PATH, EngineLoad, load_query

TICK_S = 0.01
"""How often the fake engine's iteration counter advances (a real engine reports its state after
every iteration: ~100 per second under load)."""
DEFAULT_TOKENS = 16
WORD = " tok"


class _Generate(msgspec.Struct):
    rid: str | None = None
    sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    stream: bool = False


class _Chat(msgspec.Struct):
    max_tokens: int = DEFAULT_TOKENS
    stream: bool = False


_encode = msgspec.json.Encoder().encode


def _sglang_event(rid: str, prompt_tokens: int, n: int, total: int) -> bytes:
    finish = {"type": "length", "length": total} if n == total else None
    payload = {
        "text": WORD * n,
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": 0,
        },
    }
    return _encode(payload)


@web.middleware
async def _client_gone(request: web.Request, handler: Any) -> web.StreamResponse:
    """A client (the gateway) that hangs up mid-answer is not the fake engine's error."""
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except ConnectionResetError:
        return web.Response(status=499)


async def generate(request: web.Request) -> web.StreamResponse:
    body = msgspec.json.decode(await request.read(), type=_Generate)
    total = int(body.sampling_params.get("max_new_tokens", DEFAULT_TOKENS))
    rid = body.rid or "fake"
    prompt_tokens = 8
    if not body.stream:
        return web.Response(
            body=_sglang_event(rid, prompt_tokens, total, total), content_type="application/json"
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for n in range(1, total + 1):
        await resp.write(b"data: " + _sglang_event(rid, prompt_tokens, n, total) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def chat(request: web.Request) -> web.StreamResponse:
    """The direct path: OpenAI chat chunks for the same number of tokens."""
    body = msgspec.json.decode(await request.read(), type=_Chat)
    total = body.max_tokens
    head = {"id": "chatcmpl-fake", "created": int(time.time()), "model": "fake"}
    if not body.stream:
        choice = {"index": 0, "message": {"role": "assistant", "content": WORD * total}}
        usage = {"prompt_tokens": 8, "completion_tokens": total, "total_tokens": 8 + total}
        return web.Response(
            body=_encode(
                {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
            ),
            content_type="application/json",
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for n in range(1, total + 1):
        delta = {"content": WORD}
        choice = {"index": 0, "delta": delta, "finish_reason": "length" if n == total else None}
        event = {**head, "object": "chat.completion.chunk", "choices": [choice]}
        await resp.write(b"data: " + _encode(event) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


class _Ticker:
    """The fake engine's iteration counter and the long polls waiting for its next value."""

    def __init__(self) -> None:
        self.iteration = 0
        self.changed = asyncio.Event()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.iteration += 1
            self.changed.set()
            self.changed = asyncio.Event()

    def load(self) -> EngineLoad:
        return EngineLoad(
            iteration=self.iteration,
            at_unix_s=time.time(),
            iteration_s=TICK_S,
            kv_capacity_tokens=1_000_000,
        )


_TICKER = web.AppKey("fake_ticker", _Ticker)


async def load(request: web.Request) -> web.Response:
    ticker = request.app[_TICKER]
    after, wait_s = load_query(request.query.get("after"), request.query.get("wait_s"))
    if ticker.iteration <= after:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ticker.changed.wait(), wait_s)
    return web.Response(body=msgspec.json.encode(ticker.load()), content_type="application/json")


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def model_info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": "fake", "is_generation": True, "engine": "fake"})


def create_fake_engine() -> web.Application:
    """The fake engine's app (its ticker runs while the app does)."""
    app = web.Application(middlewares=[_client_gone])
    ticker = _Ticker()
    app[_TICKER] = ticker

    async def ticking(app: web.Application) -> Any:
        task = asyncio.create_task(ticker.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(ticking)
    app.add_routes(
        [
            web.post("/generate", generate),
            web.post("/v1/chat/completions", chat),
            web.post("/abort_request", ok),
            web.get("/health", ok),
            web.get("/health_generate", ok),
            web.get("/model_info", model_info),
            web.get("/get_model_info", model_info),
            web.get(CONTROL_LOAD_PATH, load),
        ]
    )
    return app
