"""The tandem policy drives the real CPU engine (issue 5), through the gateway.

What a user notices: an RT request that arrives while BE prompts fill the engine gets its first
token before those prompts are all computed (it does not queue behind them, as it would on a
first-come-first-served engine), also while a long BE prompt is half computed (the prompt sits
out the RT prompt's iteration, or makes way for an RT prompt that must be cut, and completes
with the same output); BE requests whose decodes sat out iterations complete with
the full, correct output; the engine does not admit more BE work than the KV pool can carry when
the tenant's history says its outputs are long; every request ends exactly once.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from common.wire import CONTROL_ITERATIONS_PATH, CONTROL_LOAD_PATH, RecentIterations
from gateway.state import STORE
from tests.functional.engine_fixtures import EngineServer, control, post_json, running_engine
from tests.functional.gateway_fixtures import GatewayHandle, start_gateway
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

MODEL = "tandem-tiny"


def prompt_ids(seed: int, n: int) -> list[int]:
    """A prompt of exactly *n* token ids (distinct per seed, so no prefix is shared)."""
    return [10 + (seed * 131 + i * 17) % 400 for i in range(n)]


async def complete(
    gw: GatewayHandle, key: str, prompt: list[int], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """A non-streaming greedy completion; the JSON reply."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    async with gw.session.post(
        f"{gw.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        reply = await resp.json()
        assert resp.status == 200, reply
        return dict(reply)


async def stream_chunks(
    gw: GatewayHandle, key: str, prompt: list[int], max_tokens: int, **extra: Any
) -> AsyncIterator[dict[str, Any]]:
    """A streaming greedy completion; its events, parsed, as they come (none an error)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    async with gw.session.post(
        f"{gw.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            assert "error" not in chunk, f"the stream ended in an error: {chunk}"
            yield chunk


async def stream_ttft(
    gw: GatewayHandle, key: str, prompt: list[int], max_tokens: int
) -> tuple[float, int]:
    """A streaming completion; (seconds to the first content chunk, chunks with text)."""
    start = time.perf_counter()
    first: float | None = None
    chunks = 0
    async for chunk in stream_chunks(gw, key, prompt, max_tokens):
        if chunk["choices"] and chunk["choices"][0].get("text"):
            chunks += 1
            if first is None:
                first = time.perf_counter() - start
    assert first is not None, "no token came back"
    return first, chunks


def stats(engine: EngineServer) -> dict[str, Any]:
    status, body = control(engine, "GET", "/stats")
    assert status == 200, body
    return dict(body)


async def reached_the_scheduler(engine: EngineServer, tenant_id: str, count: int) -> None:
    """Waits until the engine's scheduler has created *count* requests of the tenant (its trace
    has a record per created request)."""

    def created() -> bool:
        rids = {
            r["rid"]
            for r in engine.read_trace()
            if (r.get("meta") or {}).get("tenant_id") == tenant_id
        }
        return len(rids) >= count

    await wait_until(created, timeout_s=60, what=f"{count} requests of {tenant_id} on the engine")


async def first_token_at(
    gw: GatewayHandle, key: str, prompt: list[int], max_tokens: int
) -> tuple[float, int]:
    """A streamed completion timed by token (`continuous_usage_stats`: an event per token step,
    so a token whose text is not complete yet is still seen); (`time.perf_counter()` when its
    first token came, its output tokens)."""
    first: float | None = None
    tokens = 0
    usage_events = {"stream_options": {"continuous_usage_stats": True}}
    async for chunk in stream_chunks(gw, key, prompt, max_tokens, **usage_events):
        tokens = max(tokens, (chunk.get("usage") or {}).get("completion_tokens") or 0)
        if first is None and tokens:
            first = time.perf_counter()
    assert first is not None, "no token came back"
    return first, tokens


async def test_an_rt_prompt_does_not_queue_behind_the_be_prompts_before_it(
    gateway: GatewayHandle, engine_server: EngineServer
) -> None:
    be_id, be_key = await gateway.new_tenant("colo-fill-be", "be")
    # admitted whatever the forecast says: on a busy host the SLO admission may refuse the
    # request (its target is then out of reach), and this is about where the engine puts it
    _, rt_key = await gateway.new_tenant(
        "colo-fill-rt", "rt", ttft_ms=2500, tpot_ms=1000, on_unattainable="accept"
    )
    # 12 BE prompts of 400 tokens: ~10 prefill chunks of 512 ahead of any FCFS newcomer.
    be = [
        asyncio.create_task(first_token_at(gateway, be_key, prompt_ids(i, 400), 40))
        for i in range(12)
    ]
    await reached_the_scheduler(engine_server, be_id, 12)
    rt_first, rt_tokens = await first_token_at(gateway, rt_key, prompt_ids(100, 64), 16)
    replies = await asyncio.gather(*be)
    be_prompts_done = max(first for first, _ in replies)  # the last BE prompt's first token
    # compared within the run, not with the wall clock: a slower host stretches both
    assert rt_first < be_prompts_done, (
        f"the RT prompt waited for every BE prompt before it: its first token came "
        f"{rt_first - be_prompts_done:.2f} s after the last BE prompt's"
    )
    assert rt_tokens == 16
    assert [tokens for _, tokens in replies] == [40] * 12


LONG_BE_PROMPT_TOKENS = 3500
"""A BE prompt deep enough into the tiny model's 4096-token context that each chunk of it costs
mostly its prefix on the engine below: several chunks of 512."""


@pytest.fixture(scope="module")
def deep_chunk_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An engine on which a chunk deep into a prompt costs about its whole prefix: SGLang's own
    CPU attention (`torch_native_extend: stock`) computes every chunk over the whole sequence.
    tandem's default kernel computes a chunk's own rows, and there a 3,500-token prompt's
    chunks are short enough to ride beside an RT prompt; the park-and-release path below is for
    a backend (or a context) where they are not."""
    # Slowed 3x (`engine.slowdown`: a sleep after each pass, no CPU taken) so that the gateway's
    # round trip between one RT prompt and the next is short next to the BE prompt's chunks:
    # on a fast host the BE prompt was all computed before the second RT prompt came.
    with running_engine(
        tmp_path_factory.mktemp("deep-chunk-engine"), torch_native_extend="stock", slowdown="3"
    ) as engine:
        yield engine


@pytest.fixture
async def deep_chunk_gateway(
    deep_chunk_engine: EngineServer, tmp_path: Path
) -> AsyncIterator[GatewayHandle]:
    server, gw = await start_gateway(
        f"sqlite:///{tmp_path / 'tandem.db'}", deep_chunk_engine.port, deep_chunk_engine.model_path
    )
    try:
        yield gw
    finally:
        await gw.session.close()
        await server.close()


async def _mid_prefill(engine: EngineServer) -> None:
    """Waits until the engine holds a BE request whose prompt is partly computed."""

    def partly_computed() -> bool:
        status, load = control(engine, "GET", CONTROL_LOAD_PATH)
        assert status == 200, load
        # some of its prompt in the KV, and most of it still to compute
        return load["be_kv_tokens"] >= 512 and load["be_waiting_prompt_tokens"] >= 1024

    await wait_until(
        partly_computed, timeout_s=60, what="the long BE prompt half computed", max_interval_s=0.02
    )


MAX_RT_PROMPTS_BESIDE = 12
"""At most this many RT prompts are sent, one after the other, beside the long BE prompt."""


def _be_prompt_computing(engine: EngineServer) -> bool:
    status, load = control(engine, "GET", CONTROL_LOAD_PATH)
    assert status == 200, load
    return bool(load["be_waiting_prompt_tokens"] > 0)


async def _long_be_prompt_alone(
    gw: GatewayHandle, engine: EngineServer, name: str, seed: int
) -> tuple[str, str, list[int], str]:
    """A BE and an RT tenant (`name`-be, `name`-rt), a long BE prompt and its greedy output
    alone, with the prefix cache emptied after (so the run beside RT computes the prompt again
    rather than finding it cached): (BE key, RT key, prompt, output alone)."""
    _, be_key = await gw.new_tenant(f"{name}-be", "be")
    _, rt_key = await gw.new_tenant(
        f"{name}-rt", "rt", ttft_ms=5000, tpot_ms=1000, on_unattainable="accept"
    )
    prompt = prompt_ids(seed, LONG_BE_PROMPT_TOKENS)
    alone = await complete(gw, be_key, prompt, 8)
    status, body = await asyncio.to_thread(post_json, engine.base_url, "/flush_cache", {})
    assert status == 200, body
    assert control(engine, "POST", "/stats/reset")[0] == 200
    return be_key, rt_key, prompt, str(alone["choices"][0]["text"])


async def test_an_rt_prompt_does_not_wait_for_a_chunk_of_a_long_be_prompt(
    deep_chunk_gateway: GatewayHandle, deep_chunk_engine: EngineServer
) -> None:
    gateway, engine_server = deep_chunk_gateway, deep_chunk_engine
    be_key, rt_key, long_prompt, alone = await _long_be_prompt_alone(
        gateway, engine_server, "colo-long", 600
    )
    status, log = control(engine_server, "GET", CONTROL_ITERATIONS_PATH)
    assert status == 200, log
    after = max([r[0] for r in log["iterations"]], default=-1)

    be = asyncio.create_task(complete(gateway, be_key, long_prompt, 8))
    await _mid_prefill(engine_server)
    # short RT prompts, one after the other, for as long as the BE prompt is being computed
    for i in range(MAX_RT_PROMPTS_BESIDE):
        await complete(gateway, rt_key, prompt_ids(700 + i, 48), 4)
        if not _be_prompt_computing(engine_server):
            break
    beside = await be
    counters = stats(engine_server)

    assert beside["choices"][0]["text"] == alone, "the BE prompt's output changed"
    assert counters["parked_chunks"] >= 1, counters
    status, log = control(engine_server, "GET", f"{CONTROL_ITERATIONS_PATH}?after={after}")
    assert status == 200, log
    runs = [r for r in msgspec.convert(log, RecentIterations).iterations if r.mix is not None]

    def prefix_of(mix: Any) -> int:  # the one prompt's prefix: F_p = (prefix + chunk)²
        return round(mix.prefill_attn_full**0.5) - mix.prefill_tokens

    rt_prompts = [
        r.iteration_s
        for r in runs
        if r.mix.num_prefill == 1
        and r.mix.num_decode == 0
        and prefix_of(r.mix) == 0
        and r.mix.prefill_tokens <= 64
    ]
    deep_be_chunks = [
        r.iteration_s
        for r in runs
        if r.mix.num_prefill == 1 and r.mix.num_decode == 0 and prefix_of(r.mix) >= 2048
    ]
    assert rt_prompts and deep_be_chunks, runs
    # Compared within the run (medians: one iteration a busy host stalls does not decide it):
    # before, the BE prompt advanced by a few tokens in every RT prompt's iteration, and paid
    # for its whole prefix there (as long as a BE chunk itself).
    assert statistics.median(rt_prompts) < 0.5 * statistics.median(deep_be_chunks), (
        f"RT prompt iterations {rt_prompts} vs the BE prompt's deep chunks {deep_be_chunks}"
    )


async def test_an_rt_prompt_that_must_be_cut_does_not_wait_for_a_long_be_prompt(
    deep_chunk_gateway: GatewayHandle, deep_chunk_engine: EngineServer
) -> None:
    gateway, engine_server = deep_chunk_gateway, deep_chunk_engine
    be_key, rt_key, long_prompt, alone = await _long_be_prompt_alone(
        gateway, engine_server, "colo-cut", 800
    )

    be_first: list[float] = []

    async def be_run() -> dict[str, Any]:
        text = ""
        usage: dict[str, Any] = {}
        async for chunk in stream_chunks(
            gateway, be_key, long_prompt, 8, stream_options={"continuous_usage_stats": True}
        ):
            usage = chunk.get("usage") or usage
            if usage.get("completion_tokens") and not be_first:
                be_first.append(time.perf_counter())
            if chunk["choices"]:
                text += chunk["choices"][0].get("text") or ""
        return {"text": text, "usage": usage}

    be = asyncio.create_task(be_run())
    await _mid_prefill(engine_server)
    # 1500 tokens: longer than the engine's chunk (512), so SGLang must cut it, and it cuts one
    # prompt at a time — before, the RT prompt waited until the BE prompt was all computed.
    rt_first, rt_tokens = await first_token_at(gateway, rt_key, prompt_ids(900, 1500), 4)
    beside = await be
    counters = stats(engine_server)

    assert rt_tokens == 4 and beside["usage"]["completion_tokens"] == 8
    assert be_first and rt_first < be_first[0], (
        f"the RT prompt's first token came {rt_first - be_first[0]:.2f} s after the BE prompt's"
    )
    assert counters["released_chunks"] >= 1, counters
    # it resumed from the KV it had computed (kept in the prefix cache), with the same output
    assert beside["text"] == alone, "the BE prompt's output changed"


async def test_be_decodes_that_sat_out_complete_with_the_right_tokens(
    gateway: GatewayHandle, engine_server: EngineServer
) -> None:
    be_id, be_key = await gateway.new_tenant("colo-park-be", "be")
    # A 5 ms TPOT target is tighter than any CPU iteration: every iteration that carries RT
    # tokens leaves BE only its minimum share, whatever the machine's speed.
    # A contract the CPU engine cannot keep on purpose (it drives the scheduler): the gateway's
    # SLO admission must let it through as RT.
    _, rt_key = await gateway.new_tenant(
        "colo-park-rt", "rt", ttft_ms=1000, tpot_ms=5, on_unattainable="accept"
    )
    # Twelve BE requests with 400-token contexts: their decodes cost more than a tight RT
    # TPOT leaves once the RT rows are in.
    prompts = [prompt_ids(200 + i, 400) for i in range(12)]
    solo = [await complete(gateway, be_key, p, 150) for p in prompts]

    assert control(engine_server, "POST", "/stats/reset")[0] == 200
    be = [asyncio.create_task(complete(gateway, be_key, p, 150)) for p in prompts]
    await reached_the_scheduler(engine_server, be_id, 24)  # the 12 solo runs, and these 12
    # RT streams while BE decodes: the BE rows must make room.
    await asyncio.gather(
        *(stream_ttft(gateway, rt_key, prompt_ids(300 + i, 32), 80) for i in range(4))
    )
    together = await asyncio.gather(*be)
    counters = stats(engine_server)
    assert counters["parked_decodes"] > 0, f"no BE decode sat an iteration out: {counters}"
    # RT and BE shared iterations: RT work accounts for part of the busy time, not all of it
    assert 0.0 < counters["rt_time_frac"] < 1.0, counters
    for alone, shared in zip(solo, together, strict=True):
        assert shared["usage"]["completion_tokens"] == 150
        assert shared["choices"][0]["text"] == alone["choices"][0]["text"]


async def test_a_conversations_next_turn_is_planned_from_its_cached_history(
    gateway: GatewayHandle, engine_server: EngineServer
) -> None:
    # The policy plans what SGLang will compute: the new turn's few tokens beside the history
    # the prefix cache holds, not the whole conversation from its first token (which the plan,
    # the latency model's calibration and the SLO admission would all count as work to do).
    _, rt_key = await gateway.new_tenant(
        "colo-turns", "rt", ttft_ms=5000, tpot_ms=1000, on_unattainable="accept"
    )
    history = prompt_ids(900, 1500)
    await complete(gateway, rt_key, history, 4)
    status, log = control(engine_server, "GET", CONTROL_ITERATIONS_PATH)
    assert status == 200, log
    after = max([r[0] for r in log["iterations"]], default=-1)
    before = stats(engine_server)

    await complete(gateway, rt_key, history + prompt_ids(901, 40), 4)
    counters = stats(engine_server)
    assert counters["waiting_cached_tokens"] - before["waiting_cached_tokens"] >= 1400, counters
    status, log = control(engine_server, "GET", f"{CONTROL_ITERATIONS_PATH}?after={after}")
    assert status == 200, log
    prompts = [
        r.mix
        for r in msgspec.convert(log, RecentIterations).iterations
        if r.mix is not None and r.mix.num_prefill == 1
    ]
    # one prompt iteration: the 40 new tokens (and at most the cache's last block) after the
    # history, where the plan used to be the conversation's first 512-token chunk
    assert len(prompts) == 1, prompts
    prefix = round(prompts[0].prefill_attn_full ** 0.5) - prompts[0].prefill_tokens
    assert prompts[0].prefill_tokens <= 64 and prefix >= 1400, prompts[0]


@pytest.fixture(scope="module")
def small_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An engine whose KV pool holds four 340-token requests but not five."""
    with running_engine(
        tmp_path_factory.mktemp("small-engine"),
        max_total_tokens=1400,
        chunked_prefill_size=256,
        max_running_requests=8,
    ) as engine:
        yield engine


async def _run_five(gw: GatewayHandle, engine: EngineServer, key: str) -> dict[str, Any]:
    """Five BE requests of 60 + 280 tokens at once; the engine's counters for the run."""
    assert control(engine, "POST", "/stats/reset")[0] == 200
    replies = await asyncio.gather(
        *(complete(gw, key, prompt_ids(400 + i, 60), 280) for i in range(5))
    )
    assert [r["usage"]["completion_tokens"] for r in replies] == [280] * 5
    return stats(engine)


async def test_admission_follows_the_tenants_length_history(
    small_engine: EngineServer, tmp_path: Path
) -> None:
    db = tmp_path / "tandem.db"
    server, gw = await start_gateway(f"sqlite:///{db}", small_engine.port, small_engine.model_path)
    try:
        long_id, long_key = await gw.new_tenant("history-long", "be")
        short_id, short_key = await gw.new_tenant("history-short", "be")
        rows = [(long_id, 280, 60)] * 30 + [(short_id, 8, 60)] * 30
        await gw.app[STORE].append_lengths(rows, window=1000)
        # The gateway pushes SQL histories to the engine when it first reaches it; start a
        # fresh sync by waiting for the engine to report them.
        await wait_until(
            lambda: stats(small_engine)["history_lengths"] >= 60,
            what=lambda: f"the histories pushed to the engine: {stats(small_engine)}",
        )

        long_run = await _run_five(gw, small_engine, long_key)
        # 5 × (60 + 280) = 1700 tokens do not fit in 1400: the history says the outputs are
        # long, so a request is admitted only when the predicted future peak fits (a fifth may
        # join once the first ones are nearly done), and no running request ever has to give
        # its KV back.
        assert long_run["peak_kv_used_tokens"] <= 1400, long_run
        assert long_run["retractions_ordered"] == 0 and long_run["evictions"] == 0, long_run

        short_run = await _run_five(gw, small_engine, short_key)
        # The same requests from a tenant whose history says 8 tokens: all five admitted at
        # once, the pool overflows and requests are evicted (and still complete, above).
        assert short_run["peak_running"] == 5, short_run
        assert short_run["retractions_ordered"] + short_run["evictions"] > 0, short_run
    finally:
        await gw.session.close()
        await server.close()


async def test_every_request_ends_exactly_once(
    gateway: GatewayHandle, engine_server: EngineServer
) -> None:
    be_id, be_key = await gateway.new_tenant("colo-once-be", "be")
    rt_id, rt_key = await gateway.new_tenant("colo-once-rt", "rt", ttft_ms=3000, tpot_ms=500)

    async def cancelled_stream(i: int) -> None:
        first_token = asyncio.Event()

        async def stream() -> None:
            body = {
                "model": MODEL,
                "prompt": prompt_ids(500 + i, 40),
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            }
            async with gateway.session.post(
                f"{gateway.base_url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {rt_key}"},
            ) as resp:
                assert resp.status == 200, await resp.text()
                async for raw in resp.content:
                    if raw.startswith(b"data:"):
                        first_token.set()

        task = asyncio.create_task(stream())
        await asyncio.wait_for(first_token.wait(), timeout=120)
        task.cancel()  # the client goes away mid-stream
        with pytest.raises(asyncio.CancelledError):
            await task

    jobs = [complete(gateway, be_key, prompt_ids(600 + i, 150), 30) for i in range(10)]
    jobs += [stream_ttft(gateway, rt_key, prompt_ids(700 + i, 40), 20) for i in range(6)]
    jobs += [cancelled_stream(i) for i in range(3)]
    await asyncio.gather(*jobs)

    be_records = await gateway.latest_requests(be_id, 50)
    rt_records = await _settled_records(gateway, rt_id, 9)
    assert len(be_records) == 10 and all(r["status"] == "ok" for r in be_records)
    assert len({r["request_id"] for r in be_records + rt_records}) == 19
    statuses = sorted(r["status"] for r in rt_records)
    assert statuses.count("ok") == 6 and len(statuses) == 9, statuses
    # The engine created each request once, and holds none of them now.
    trace_rids = [r["rid"] for r in engine_server.read_trace()]
    for record in be_records + rt_records:
        assert sum(rid.startswith(record["request_id"]) for rid in trace_rids) <= 1
    await _engine_drained(engine_server)


async def _settled_records(gw: GatewayHandle, tenant_id: str, count: int) -> list[dict[str, Any]]:
    """The tenant's records once *count* exist (a disconnect is recorded when the gateway
    notices it)."""

    async def settled() -> list[dict[str, Any]] | None:
        records = await gw.latest_requests(tenant_id, 50)
        return records if len(records) >= count else None

    return await wait_until(settled, what=f"{count} usage records of {tenant_id}")


async def _engine_drained(engine: EngineServer) -> None:
    from tests.functional.engine_fixtures import get_json

    last: list[Any] = [None]

    async def drained() -> bool:
        status, loads = await asyncio.to_thread(get_json, engine.base_url, "/v1/loads")
        assert status == 200, loads
        last[0] = body = loads[0] if isinstance(loads, list) else loads
        text = json.dumps(body)
        return '"num_running_reqs": 0' in text and '"num_waiting_reqs": 0' in text

    await wait_until(drained, what=lambda: f"the engine drained (loads: {last[0]})")
