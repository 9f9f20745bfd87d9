"""Bounded queues per tier as a client sees them: past its tier's bound of requests in flight on
the engine, a request is refused at once with 429 `tier_queue_full` and Retry-After (never queued
without end), the refusal is in the usage record and on /metrics like a quota's, the other tier
is untouched, and a place frees as soon as a request ends."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from tests.gateway.conftest import GatewayFactory
from tests.gateway.harness import MODEL, Gateway, Reply, metric
from tests.gateway.test_batches import chat_line, create_batch, jsonl, upload, wait_for
from tests.waiting import wait_until

BOUNDS = {"TANDEM_GATEWAY__MAX_INFLIGHT_RT": "2", "TANDEM_GATEWAY__MAX_INFLIGHT_BE": "1"}


def assert_queue_full(reply: Reply, tier: str, bound: int) -> None:
    assert reply.status == 429, reply
    error = reply.error
    assert error["type"] == "rate_limit_error" and error["code"] == "tier_queue_full"
    assert f"{tier.upper()} queue is full" in error["message"]
    assert f"{bound} {tier.upper()} requests" in error["message"]
    assert int(reply.headers["Retry-After"]) >= 1


@asynccontextmanager
async def held(gw: Gateway, key: str) -> AsyncIterator[aiohttp.ClientResponse]:
    """A long streamed request, in flight on the engine until the block ends (then dropped)."""
    body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True}
    async with gw.session.post(
        f"{gw.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        assert resp.status == 200
        await resp.content.readline()  # its first chunk: it is on the engine
        yield resp
        resp.connection.transport.abort()  # type: ignore[union-attr]


async def test_a_be_request_over_the_be_bound_is_refused_at_once_and_rt_still_runs(
    make_gateway: GatewayFactory,
) -> None:
    async with make_gateway(**BOUNDS) as gw:
        be_id, be_key = await gw.new_tenant("be", tier="be")
        _, rt_key = await gw.new_tenant("rt")
        async with held(gw, be_key):
            assert_queue_full(await gw.chat(be_key, max_tokens=1), "be", 1)
            assert (await gw.chat(rt_key, max_tokens=1)).status == 200  # RT's queue is its own
        records = await gw.records(be_id, 2)
        refused = next(r for r in records if r["http_status"] == 429)
        assert refused["status"] == "rate_limited"
        assert "BE queue is full" in refused["error"]
        assert refused["slo_met"] is None and refused["completion_tokens"] == 0
        samples = await gw.metrics()
        assert metric(samples, "tandem_quota_rejections_total", tenant=be_id, limit="be_queue")

        async def place_free() -> bool:
            reply = await gw.chat(be_key, max_tokens=1)
            if reply.status == 429:
                assert_queue_full(reply, "be", 1)
            return reply.status == 200

        await wait_until(place_free, what="the BE place given back after the disconnect")


async def test_rt_over_its_own_bound_is_refused_and_batch_lines_are_not_counted(
    make_gateway: GatewayFactory,
) -> None:
    async with make_gateway(**BOUNDS) as gw:
        _, rt_key = await gw.new_tenant("rt")
        async with held(gw, rt_key), held(gw, rt_key):
            assert_queue_full(await gw.chat(rt_key, max_tokens=1), "rt", 2)
        _, be_key = await gw.new_tenant("be-batch", tier="be")
        async with held(gw, be_key):  # the interactive BE queue is full: a batch still runs
            lines = [chat_line(f"l{i}", f"hi {i}", max_tokens=2) for i in range(3)]
            file = await upload(gw, be_key, jsonl(lines))
            assert file.status == 200, file
            batch = await create_batch(gw, be_key, file.body["id"])
            assert batch.status == 200, batch
            done = await wait_for(gw, be_key, batch.body["id"])
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
