"""The engine's live state at the gateway (gateway/engine/load.py): the simulator's ``GET /load``
long poll, and the gateway's watcher following it — an RT request shows on the gateway's
``/metrics`` (`tandem_engine_load_requests`) while it runs, and is gone once it finished."""

from __future__ import annotations

from typing import Any

from tests.gateway.harness import Gateway, metric
from tests.waiting import wait_until


async def get_load(gw: Gateway, **query: Any) -> dict[str, Any]:
    params = {k: str(v) for k, v in query.items()}
    async with gw.session.get(gw.engine_url + "/load", params=params) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert isinstance(body, dict)
    return body


async def rt_requests(gw: Gateway, engine: str) -> float | None:
    """RT requests (waiting + running) in the gateway's view of the engine; None before its
    first report."""
    m = await gw.metrics()
    waiting = metric(m, "tandem_engine_load_requests", engine=engine, tier="rt", state="waiting")
    running = metric(m, "tandem_engine_load_requests", engine=engine, tier="rt", state="running")
    if waiting is None or running is None:
        return None
    return waiting + running


async def test_the_simulator_answers_the_long_poll(gw: Gateway) -> None:
    now = await get_load(gw, after=-1, wait_s=5)  # an iteration past -1 always "ran": at once
    assert now["iteration"] >= 0 and now["kv_capacity_tokens"] > 0
    idle = await get_load(gw, after=now["iteration"] + 1000, wait_s=0.05)  # none that late
    assert idle["iteration"] < now["iteration"] + 1000
    async with gw.session.get(gw.engine_url + "/load", params={"wait_s": "-1"}) as resp:
        assert resp.status == 400


async def test_the_watcher_shows_a_running_rt_request_then_none(gw: Gateway) -> None:
    _, key = await gw.new_tenant("live")
    engine = gw.engine_url
    await wait_until(
        lambda: _reported(rt_requests(gw, engine)),
        timeout_s=10,
        what="the engine's first load report",
    )
    before = await get_load(gw, after=-1)
    body = {
        "model": "tandem-tiny",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 600,
        "stream": True,
    }
    async with gw.session.post(
        gw.base_url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        assert resp.status == 200
        seen = await wait_until(
            lambda: _at_least_one(rt_requests(gw, engine)),
            timeout_s=10,
            what="the running RT request in the gateway's view of the engine",
        )
        assert seen >= 1
        async for _ in resp.content:  # to the end of the stream: the request finishes
            pass
    await wait_until(
        lambda: _none(rt_requests(gw, engine)),
        timeout_s=10,
        what="no RT request left in the gateway's view of the engine",
    )
    after = await get_load(gw, after=-1)
    assert after["iteration"] > before["iteration"]

    async def caught_up() -> Any:
        m = await gw.metrics()
        shown = metric(m, "tandem_engine_load_iteration", engine=engine)
        return m if shown is not None and shown >= after["iteration"] else None

    m = await wait_until(caught_up, timeout_s=10, what="the watcher at the engine's iteration")
    assert (metric(m, "tandem_engine_load_age_seconds", engine=engine) or 0.0) >= 0.0
    missed = metric(m, "tandem_engine_load_missed_iterations", engine=engine)
    assert missed is not None
    print(f"load watcher: iteration {after['iteration']}, missed {missed:.0f}")  # staleness


async def _reported(count: Any) -> bool:
    return await count is not None


async def _at_least_one(count: Any) -> float | None:
    value = await count
    return value if value is not None and value >= 1 else None


async def _none(count: Any) -> bool:
    return await count == 0
