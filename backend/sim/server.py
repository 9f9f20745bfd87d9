"""The simulator behind SGLang's HTTP surface, on a real clock, so the gateway can front it.

Routes (the subset of SGLang's native API the gateway and benchmark clients use):
POST /generate (streaming SSE or JSON), POST /abort_request, GET /health, /health_generate,
/model_info (alias /get_model_info), /v1/loads; and tandem's `GET /load` long poll
(`common.wire.CONTROL_LOAD_PATH`), which the patched engine serves on its control socket: the
simulator has no control socket, so the gateway asks its HTTP port instead.

Generation is fake but deterministic: output token i is the id 100 + (7·i mod 30000) and the word
WORDS[i mod len]; every request generates exactly max_new_tokens tokens (there is no EOS model).
What a fake generation cannot honour — log probabilities, stop strings, grammar-constrained
output — is refused with a 400 naming it (`UNMODELLED`), never ignored: the gateway passes the
refusal on to its client.
Prompt tokens are counted from `input_ids` (a word count for `text`); full 512-token blocks of
`input_ids` get chained hashes, so repeated prefixes hit the simulated prefix cache.

    python -m backend.sim.server --profile bench/profiles/X.json --port 30000 --policy fcfs
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.registry import make_policy
from backend.policy.types import Policy
from backend.sim.config import SimConfig
from backend.sim.realtime import RealtimeEngine, Stream
from backend.sim.source import SimRequest
from common.wire import (
    CONTROL_LOAD_PATH,
    PRIORITY_RT,
    RequestMeta,
    Tier,
    load_query,
    meta_from_custom_params,
)

ENGINE = web.AppKey("sim_engine", RealtimeEngine)
MODEL_NAME = web.AppKey("sim_model_name", str)
WORDS = (
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
    "incididunt",
    "ut",
    "labore",
    "et",
    "dolore",
    "magna",
)
DEFAULT_MAX_NEW_TOKENS = 128


class _Output:
    """The fake output's first tokens, grown on demand and shared by every request: a stream
    sends its cumulative text and ids on every update, and rebuilding them token by token made
    a long stream O(n²) Python work; slicing a shared prefix is a memcpy."""

    def __init__(self) -> None:
        self.text = ""
        self.ends: list[int] = [0]  # ends[i]: characters of the first i tokens' text
        self.ids: list[int] = []

    def first(self, n: int) -> tuple[str, list[int]]:
        """The text and token ids of the first *n* output tokens."""
        if n > len(self.ids):
            start = len(self.ids)
            words = [" " + WORDS[i % len(WORDS)] for i in range(start, n)]
            self.text += "".join(words)
            for w in words:
                self.ends.append(self.ends[-1] + len(w))
            self.ids.extend(100 + (7 * i) % 30000 for i in range(start, n))
        return self.text[: self.ends[n]], self.ids[:n]


_OUTPUT = _Output()


class GenerateBody(msgspec.Struct):
    """The `/generate` fields the simulator reads (others are accepted and ignored)."""

    rid: str | None = None
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    stream: bool = False
    priority: int | None = None
    return_logprob: bool = False


UNMODELLED: dict[str, str] = {
    "stop": "stop strings",
    "stop_token_ids": "stop tokens",
    "json_schema": "grammar-constrained output (json_schema)",
    "regex": "grammar-constrained output (regex)",
    "ebnf": "grammar-constrained output (ebnf)",
}
"""Sampling parameters the simulator's fake text cannot honour, and what they ask for."""


def create_sim_app(
    policy: Policy,
    latency: LatencyModel,
    config: SimConfig,
    *,
    model_name: str = "tandem-sim",
    time_scale: float = 1.0,
) -> web.Application:
    """The HTTP app serving `policy` on the simulated engine (the engine loop runs while the app
    does)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[MODEL_NAME] = model_name
    engine = RealtimeEngine(policy, latency, config, time_scale=time_scale)
    app[ENGINE] = engine

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(engine_loop)
    app.add_routes(
        [
            web.post("/generate", generate),
            web.post("/abort_request", abort_request),
            web.get("/health", health),
            web.get("/health_generate", health),
            web.get("/model_info", model_info),
            web.get("/get_model_info", model_info),
            web.get("/v1/loads", loads),
            web.get(CONTROL_LOAD_PATH, engine_load),
        ]
    )
    return app


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


def _sim_request(body: GenerateBody, arrival_s: float) -> SimRequest:
    """The simulator's request for a `/generate` body; raises ValueError when it is bad."""
    if body.input_ids is not None:
        prompt_len = len(body.input_ids)
    elif body.text is not None:
        prompt_len = max(1, len(body.text.split()))
    else:
        raise ValueError("one of input_ids or text is required")
    if prompt_len < 1:
        raise ValueError("the prompt is empty")
    params = body.sampling_params
    if body.return_logprob:
        raise ValueError("the simulator does not model log probabilities (return_logprob)")
    for name, what in UNMODELLED.items():
        if params.get(name):
            raise ValueError(f"the simulator does not model {what}: sampling_params.{name}")
    max_new = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    if max_new < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    try:
        meta = meta_from_custom_params(params.get("custom_params"))
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad custom_params: {exc}") from None
    late_s = 0.0 if meta is None else max(0.0, time.time() - meta.arrival_unix_s)
    return SimRequest(
        rid=body.rid or uuid.uuid4().hex,
        tier=_tier(meta, body.priority),
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        output_len=max_new,
        max_new_tokens=max_new,
        ttft_target_s=_left(meta.ttft_target_ms, 1e-3, late_s) if meta else None,
        tpot_target_s=meta.tpot_target_ms / 1000.0
        if meta and meta.tpot_target_ms is not None
        else None,
        deadline_s=_left(meta.deadline_s, 1.0, late_s) if meta else None,
        length_key=meta.length_key if meta else "",
        tenant_id=meta.tenant_id if meta else "",
        tenant_weight=meta.tenant_weight if meta else 1.0,
        prefix_hashes=_block_hashes(body.input_ids or [], 512),
    )


def _tier(meta: RequestMeta | None, priority: int | None) -> Tier:
    if meta is not None:
        return meta.tier
    return "be" if priority is not None and priority < PRIORITY_RT else "rt"


def _left(value: float | None, unit_s: float, late_s: float) -> float | None:
    """A target relative to the gateway's arrival, made relative to the engine's."""
    return None if value is None else max(0.0, value * unit_s - late_s)


def _block_hashes(ids: list[int], block: int) -> tuple[int, ...]:
    """Chained hashes of the full `block`-token blocks (equal hash ⇔ equal prefix)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        out.append(h)
    return tuple(out)


def _payload(engine: RealtimeEngine, stream: Stream) -> dict[str, Any]:
    """SGLang's cumulative output object for a stream's current state."""
    n = stream.completion_tokens
    t = stream.track
    queue_time = None if t.admitted_s is None else t.admitted_s - t.state.arrival_s
    text, output_ids = _OUTPUT.first(n)
    return {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": stream.rid,
            "finish_reason": stream.finish_reason,
            "prompt_tokens": t.state.prompt_len,
            "completion_tokens": n,
            "cached_tokens": t.first_cached or 0,
            "queue_time": queue_time,
            "num_retractions": t.state.num_evictions,
            "e2e_latency": engine.now() - t.state.arrival_s,
        },
    }


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    if engine.error is not None:
        return web.json_response({"error": {"message": engine.error}}, status=503)
    try:
        body = msgspec.json.decode(await request.read(), type=GenerateBody)
        stream = engine.submit(_sim_request(body, engine.now()))
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        return _bad_request(str(exc))
    try:
        if not body.stream:
            while stream.finish_reason is None:
                await _next_change(stream)
            return web.json_response(_payload(engine, stream))
        return await _stream(request, engine, stream)
    finally:
        if stream.finish_reason is None:  # the client left (or the handler failed)
            engine.abort(stream.rid)


async def _next_change(stream: Stream) -> None:
    await stream.changed.wait()
    stream.changed.clear()


async def _stream(
    request: web.Request, engine: RealtimeEngine, stream: Stream
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    sent = 0
    try:
        while True:
            await _next_change(stream)
            if stream.completion_tokens > sent or stream.finish_reason is not None:
                sent = stream.completion_tokens
                data = msgspec.json.encode(_payload(engine, stream))
                await resp.write(b"data: " + data + b"\n\n")
            if stream.finish_reason is not None:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client hung up mid-stream: its request is aborted
        pass
    return resp


async def abort_request(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return _bad_request("body must be JSON")
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(rid, str):
        request.app[ENGINE].abort(rid)
    return web.Response()


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.error is not None:
        return web.Response(status=503, text=engine.error)
    return web.Response(text="OK")


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = request.app[MODEL_NAME]
    return web.json_response(
        {
            "model_path": name,
            "tokenizer_path": name,
            "is_generation": True,
            "engine": "tandem-sim",
            "policy": engine.policy.name,
        }
    )


async def loads(request: web.Request) -> web.Response:
    return web.json_response({"version": "tandem-sim", "loads": [request.app[ENGINE].loads()]})


async def engine_load(request: web.Request) -> web.Response:
    """`GET /load?after=N&wait_s=S`: the engine's live state once iteration N+1 has run."""
    try:
        after, wait_s = load_query(request.query.get("after"), request.query.get("wait_s"))
    except ValueError as exc:
        return _bad_request(str(exc))
    load = await request.app[ENGINE].wait_load(after, wait_s)
    return web.Response(body=msgspec.json.encode(load), content_type="application/json")


def main(argv: list[str] | None = None) -> None:
    """Command line: serve a policy on the simulated engine."""
    parser = argparse.ArgumentParser(prog="python -m backend.sim.server", description=__doc__)
    parser.add_argument("--profile", required=True, help="latency profile file (JSON)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--policy", default="fcfs", help="policy name (backend.policy.registry)")
    parser.add_argument(
        "--kv-tokens", type=int, default=None, help="KV pool size, tokens (default: the profile's)"
    )
    parser.add_argument("--model-name", default="tandem-sim")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply every iteration's duration (0.1: ten times faster)",
    )
    args = parser.parse_args(argv)
    try:
        app = create_sim_app_from_profile(
            args.profile,
            args.policy,
            kv_tokens=args.kv_tokens,
            model_name=args.model_name,
            time_scale=args.time_scale,
        )
    except ValueError as exc:
        parser.error(str(exc))
    web.run_app(app, host=args.host, port=args.port)


def create_sim_app_from_profile(
    profile_path: str | Path,
    policy_name: str = "fcfs",
    *,
    kv_tokens: int | None = None,
    model_name: str = "tandem-sim",
    time_scale: float = 1.0,
) -> web.Application:
    """The app the command line serves: `policy_name` on the engine a latency profile file
    describes (KV pool: *kv_tokens*, default the profile's). Also for serving in process (tests
    put it on port 0 beside the gateway). Raises ValueError when the profile has no KV size."""
    profile = load_profile(profile_path)
    latency = LatencyModel.fit(profile.samples)
    kv = kv_tokens or profile.kv_capacity_tokens
    if kv < 1:
        raise ValueError("the profile has no kv_capacity_tokens; pass --kv-tokens")
    policy = make_policy(policy_name, latency)
    config = SimConfig(
        kv_capacity_tokens=kv,
        page_size=profile.page_size,
        max_prefill_tokens=profile.max_prefill_tokens,
        reveal_lengths=getattr(policy, "needs_true_lengths", False),
    )
    return create_sim_app(policy, latency, config, model_name=model_name, time_scale=time_scale)


if __name__ == "__main__":
    main()
