"""A stopping gateway and the requests in flight (gateway/shutdown.py): those that finish within
`gateway.shutdown_timeout_s` finish as if nothing happened; those still running then are ended
and told so — a stream with an error event and `[DONE]`, a plain request with a 503 — their
engine work stopped, and the request log says `gateway_shutdown` (read after a restart on the
same database, as an operator would). Batch lines in flight get the same time and no new one
starts; a line still running when it is up runs again after the restart, once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.gateway.conftest import GatewayFactory
from tests.gateway.harness import MODEL, Gateway, running_gateway
from tests.gateway.test_batches import chat_line, create_batch, jsonl, read_lines, upload, wait_for
from tests.waiting import wait_until

LONG = 3000
"""Output tokens of a request that runs for seconds on the simulator (a few ms a token)."""


def chat_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


async def running_on_the_engine(gw: Gateway) -> None:
    async def started() -> bool:
        return await gw.engine_running() >= 1

    await wait_until(started, 30, what="the request running on the engine")


async def lines_on_the_engine(gw: Gateway, count: int) -> None:
    async def running() -> bool:
        return await gw.engine_running() >= count

    await wait_until(running, 30, what=f"{count} batch lines running on the engine")


async def the_engine_is_idle(gw: Gateway) -> None:
    async def idle() -> bool:
        return await gw.engine_running() == 0

    await wait_until(idle, 30, what="the engine's work of the ended request stopped")


async def records_after_a_restart(
    folder: Path, tiny_model_dir: Path, engine_port: int, tenant_id: str, count: int
) -> list[dict[str, Any]]:
    async with running_gateway(folder, tiny_model_dir, engine_port) as again:
        return await again.records(tenant_id, count)


async def test_a_stream_still_running_when_the_drain_ends_is_ended_with_an_error_event(
    make_gateway: GatewayFactory, tmp_path: Path, tiny_model_dir: Path, sim_port: int
) -> None:
    async with make_gateway(TANDEM_GATEWAY__SHUTDOWN_TIMEOUT_S="0.3") as gw:
        tenant_id, key = await gw.new_tenant("drained-stream")
        stream = asyncio.create_task(gw.stream("/v1/chat/completions", key, chat_body(LONG)))
        await running_on_the_engine(gw)
        await gw.stop()
        reply, events = await asyncio.wait_for(stream, 30)
        await the_engine_is_idle(gw)
    assert reply.status == 200 and events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "gateway_shutting_down" and error["type"] == "service_unavailable", (
        error
    )
    assert "shutting down" in error["message"]
    content = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert len(content) < LONG  # it was ended, not finished

    records = await records_after_a_restart(
        tmp_path / "gateway-1", tiny_model_dir, sim_port, tenant_id, 1
    )
    assert [(r["status"], r["http_status"]) for r in records] == [("gateway_shutdown", 503)]
    assert 0 < records[0]["completion_tokens"] < LONG  # billed for what ran
    assert records[0]["slo_met"] is None  # a deploy is no SLO miss


async def test_a_plain_request_still_running_is_answered_503_to_retry(
    make_gateway: GatewayFactory, tmp_path: Path, tiny_model_dir: Path, sim_port: int
) -> None:
    async with make_gateway(TANDEM_GATEWAY__SHUTDOWN_TIMEOUT_S="0") as gw:
        tenant_id, key = await gw.new_tenant("drained-plain")
        answer = asyncio.create_task(gw.chat(key, "tell me everything", max_tokens=LONG))
        await running_on_the_engine(gw)
        await gw.stop()
        reply = await asyncio.wait_for(answer, 30)
        await the_engine_is_idle(gw)
    assert reply.status == 503, reply
    assert reply.error["code"] == "gateway_shutting_down"
    assert reply.headers["Retry-After"] == "1"
    records = await records_after_a_restart(
        tmp_path / "gateway-1", tiny_model_dir, sim_port, tenant_id, 1
    )
    assert [(r["status"], r["http_status"]) for r in records] == [("gateway_shutdown", 503)]


async def test_requests_that_finish_within_the_drain_finish_untouched(
    make_gateway: GatewayFactory, tmp_path: Path, tiny_model_dir: Path, sim_port: int
) -> None:
    async with make_gateway() as gw:  # the default drain (60 s): it ends when they do
        tenant_id, key = await gw.new_tenant("drained-in-time")
        stream = asyncio.create_task(gw.stream("/v1/chat/completions", key, chat_body(300)))
        plain = asyncio.create_task(gw.chat(key, "hi", max_tokens=300, ignore_eos=True))
        await running_on_the_engine(gw)
        await gw.stop()
        (reply, events), answer = await asyncio.wait_for(asyncio.gather(stream, plain), 60)
    assert reply.status == 200 and events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert answer.status == 200 and answer.body["usage"]["completion_tokens"] == 300
    records = await records_after_a_restart(
        tmp_path / "gateway-1", tiny_model_dir, sim_port, tenant_id, 2
    )
    assert [r["status"] for r in records] == ["ok", "ok"]


async def test_batch_lines_in_flight_finish_within_the_drain_and_no_new_line_starts(
    make_gateway: GatewayFactory, tmp_path: Path, tiny_model_dir: Path, sim_port: int
) -> None:
    ids = [f"line-{i}" for i in range(12)]
    lines = [chat_line(i, "a long story", max_tokens=300, ignore_eos=True) for i in ids]
    async with make_gateway(TANDEM_BATCH__MAX_INFLIGHT="2") as gw:
        tenant_id, key = await gw.new_tenant("drained-batch", "be")
        file_id = (await upload(gw, key, jsonl(lines))).body["id"]
        batch_id = (await create_batch(gw, key, file_id)).body["id"]

        await lines_on_the_engine(gw, 2)
        await gw.stop()

    # What the stopped gateway left, read by one that runs no batches: every line that had
    # started finished and wrote its result; the rest never started.
    folder = tmp_path / "gateway-1"
    async with running_gateway(
        folder, tiny_model_dir, sim_port, TANDEM_BATCH__RUNNER_ENABLED="false"
    ) as reader:
        batch = (await reader.request("GET", f"/v1/batches/{batch_id}", key=key)).body
        done = batch["request_counts"]["completed"]
        assert 2 <= done < len(ids), batch  # the two in flight, not the whole batch
        records = await reader.records(tenant_id, done)
        assert [r["status"] for r in records] == ["ok"] * done  # none cut off

    async with running_gateway(folder, tiny_model_dir, sim_port) as again:
        finished = await wait_for(again, key, batch_id)
        assert finished["status"] == "completed", finished
        out = await read_lines(again, key, finished["output_file_id"])
        assert [line["custom_id"] for line in out] == ids  # each once, in file order
        records = await again.records(tenant_id, len(ids))
        assert [r["status"] for r in records] == ["ok"] * len(ids)  # nothing ran twice


async def test_batch_lines_still_running_when_the_drain_ends_run_again_after_the_restart(
    make_gateway: GatewayFactory, tmp_path: Path, tiny_model_dir: Path, sim_port: int
) -> None:
    ids = ["line-0", "line-1"]
    lines = [chat_line(i, "a long story", max_tokens=LONG, ignore_eos=True) for i in ids]
    async with make_gateway(
        TANDEM_BATCH__MAX_INFLIGHT="2", TANDEM_GATEWAY__SHUTDOWN_TIMEOUT_S="0.3"
    ) as gw:
        tenant_id, key = await gw.new_tenant("cut-batch", "be")
        file_id = (await upload(gw, key, jsonl(lines))).body["id"]
        batch_id = (await create_batch(gw, key, file_id)).body["id"]
        await lines_on_the_engine(gw, 2)
        await gw.stop()
        await the_engine_is_idle(gw)  # the lines' engine work stopped with the gateway

    async with running_gateway(tmp_path / "gateway-1", tiny_model_dir, sim_port) as again:
        finished = await wait_for(again, key, batch_id, timeout_s=120)
        assert finished["status"] == "completed", finished
        out = await read_lines(again, key, finished["output_file_id"])
        assert [line["custom_id"] for line in out] == ids
        records = await again.records(tenant_id, 4)
    # each line cut once by the stop, then run once in full
    assert sorted(r["status"] for r in records) == ["interrupted"] * 2 + ["ok"] * 2, records
