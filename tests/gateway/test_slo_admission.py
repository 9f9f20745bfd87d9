"""The SLO admission as a tenant and an operator see it, on engine states set by hand: an RT
request the forecast says will miss its contract is refused at once (429 `slo_unattainable`,
Retry-After, the target and the excess named), run as BE (the response says so in
`X-Tandem-Downgraded`) or run as RT anyway, as the tenant's contract says; each outcome is in the
usage record, the usage report and on /metrics. (tests/functional/test_slo_admission.py does the
same against the real engine's reported state.)"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest_asyncio

from common.wire import EngineLoad
from gateway.engine.load import LoadWatcher
from tests.gateway.harness import MODEL, Gateway, metric, running_gateway
from tests.waiting import wait_until

SWAMPED = EngineLoad(
    iteration=10,
    at_unix_s=0.0,
    iteration_s=0.05,
    num_rt_waiting=20,
    rt_waiting_prompt_tokens=40_000,
    num_rt_running=30,
    rt_context_tokens=30_000,
)
"""40k RT prompt tokens queued: on the simulator's profile a 300 ms TTFT is forecast ~0.8 s."""
IDLE = EngineLoad(iteration=10, at_unix_s=0.0)
CONTRACT = {"ttft_ms": 300, "tpot_ms": 100}


@pytest_asyncio.fixture
async def watched(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> AsyncIterator[tuple[Gateway, LoadWatcher]]:
    """A gateway whose engine state is whatever the test sets on the watcher (swamped first)."""
    engine = f"http://127.0.0.1:{sim_port}"  # the engine's name: its base URL
    watcher = LoadWatcher(engine)
    watcher.latest = SWAMPED
    async with running_gateway(
        tmp_path, tiny_model_dir, sim_port, template_db=template_db, loads={engine: watcher}
    ) as gateway:
        yield gateway, watcher


async def tenant(gw: Gateway, on_unattainable: str, **slo: Any) -> tuple[str, str]:
    return await gw.new_tenant(on_unattainable, **CONTRACT, on_unattainable=on_unattainable, **slo)


async def test_an_unattainable_ttft_is_refused_at_once_naming_target_and_excess(
    watched: tuple[Gateway, LoadWatcher],
) -> None:
    gw, _ = watched
    tenant_id, key = await tenant(gw, "reject")
    reply = await gw.chat(key, max_tokens=4)
    assert reply.status == 429, reply
    error = reply.error
    assert (error["type"], error["code"]) == ("rate_limit_error", "slo_unattainable")
    assert "time to first token target of 300 ms" in error["message"]
    assert "ms over" in error["message"]
    assert int(reply.headers["Retry-After"]) >= 1
    (record,) = await gw.records(tenant_id)
    assert (record["status"], record["http_status"], record["admission"]) == (
        "slo_unattainable",
        429,
        "shed",
    )
    assert record["completion_tokens"] == 0 and record["slo_met"] is None
    samples = await gw.metrics()
    shed = {"tenant": tenant_id, "outcome": "shed", "target": "ttft"}
    assert metric(samples, "tandem_slo_admissions_total", **shed) == 1


async def test_a_downgraded_request_completes_as_be_and_says_so(
    watched: tuple[Gateway, LoadWatcher],
) -> None:
    gw, _ = watched
    tenant_id, key = await tenant(gw, "downgrade")
    reply = await gw.chat(key, max_tokens=4)
    assert reply.status == 200, reply
    assert reply.headers["X-Tandem-Downgraded"] == "ttft"
    assert reply.body["choices"][0]["finish_reason"] in ("stop", "length")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    streamed, events = await gw.stream("/v1/chat/completions", key, body)
    assert streamed.status == 200 and events[-1] == "[DONE]"
    assert streamed.headers["X-Tandem-Downgraded"] == "ttft"
    records = await gw.records(tenant_id, 2)
    assert [(r["tier"], r["admission"], r["status"]) for r in records] == [
        ("be", "downgraded", "ok")
    ] * 2
    report = await gw.admin("GET", f"/usage?tenant={tenant_id}")
    assert report.status == 200 and report.body["data"][0]["downgraded"] == 2


async def test_accept_runs_it_as_rt_and_counts_whether_it_met(
    watched: tuple[Gateway, LoadWatcher],
) -> None:
    gw, _ = watched
    tenant_id, key = await tenant(gw, "accept")
    reply = await gw.chat(key, max_tokens=4)
    assert reply.status == 200, reply
    assert "X-Tandem-Downgraded" not in reply.headers
    (record,) = await gw.records(tenant_id)
    assert (record["tier"], record["admission"]) == ("rt", "accepted")
    assert record["slo_met"] is not None
    samples = await gw.metrics()
    result = "met" if record["slo_met"] else "missed"
    labels = {"tenant": tenant_id, "admission": "accepted", "result": result}
    assert metric(samples, "tandem_slo_admitted_results_total", **labels) == 1
    report = await gw.admin("GET", f"/usage?tenant={tenant_id}")
    row = report.body["data"][0]
    assert (row["admitted_met"] + row["admitted_missed"], row["shed"]) == (1, 0)


async def test_a_request_the_engine_can_serve_in_time_is_admitted_as_rt(
    watched: tuple[Gateway, LoadWatcher],
) -> None:
    gw, watcher = watched
    watcher.latest = IDLE
    tenant_id, key = await tenant(gw, "reject")
    reply = await gw.chat(key, max_tokens=4)
    assert reply.status == 200 and "X-Tandem-Downgraded" not in reply.headers, reply
    (record,) = await gw.records(tenant_id)
    assert (record["tier"], record["admission"]) == ("rt", "admitted")


async def test_after_a_one_iteration_answer_the_idle_engine_judges_the_next_at_its_profile(
    watched: tuple[Gateway, LoadWatcher],
) -> None:
    """An engine that learned a slow pace (a busy host's: every forecast 40× the profile's)
    and is idle now: a chat is judged at the profile's pace, the only one an idle engine's
    iterations can check. Its one-token answer runs one iteration and leaves the engine idle;
    the next chat is judged as the first was, not as though the first still ran ahead."""
    gw, watcher = watched
    slow = EngineLoad(
        iteration=10,
        at_unix_s=time.time(),
        iteration_s=0.05,
        latency_factors=(40.0, 40.0, 40.0),
        calibration_samples=100,
    )
    watcher.latest = slow
    tenant_id, key = await tenant(gw, "reject")
    assert (await gw.chat(key, max_tokens=1)).status == 200
    # the engine's report of the iteration that ran it (it started after the send)
    watcher.update(
        msgspec.structs.replace(slow, iteration=11, at_unix_s=time.time(), iteration_s=1e-4)
    )
    second = await gw.chat(key, max_tokens=1)
    assert second.status == 200, second

    async def both_recorded() -> bool:
        return len(await gw.records(tenant_id)) == 2

    await wait_until(both_recorded, what="both chats' usage records")
    records = await gw.records(tenant_id)
    assert [(r["tier"], r["admission"]) for r in records] == [("rt", "admitted")] * 2


async def test_without_engine_state_rt_is_admitted_unchecked(
    tmp_path: Path, tiny_model_dir: Path, sim_port: int, template_db: Path
) -> None:
    """An engine that reports no live state (stock SGLang): nothing to forecast from."""
    async with running_gateway(
        tmp_path, tiny_model_dir, sim_port, template_db=template_db, loads={}
    ) as gw:
        await _admitted_unchecked(gw)


async def test_the_simulator_reports_its_state_and_rt_is_checked(gw: Gateway) -> None:
    """The app's own watcher follows the engine: an idle engine admits (checked) at once."""
    tenant_id, key = await gw.new_tenant("watched-live")
    # The engine reports after an iteration: run one, then wait for the report to arrive.
    assert (await gw.chat(key, max_tokens=2)).status == 200

    async def reported() -> bool:
        return any(name == "tandem_engine_load_iteration" for name, _ in await gw.metrics())

    await wait_until(reported, what="the engine's first load report at the gateway")
    assert (await gw.chat(key, max_tokens=2)).status == 200
    records = await gw.records(tenant_id)
    assert (records[-1]["tier"], records[-1]["admission"]) == ("rt", "admitted")


async def _admitted_unchecked(gw: Gateway) -> None:
    tenant_id, key = await gw.new_tenant("unwatched")
    assert (await gw.chat(key, max_tokens=2)).status == 200
    (record,) = await gw.records(tenant_id)
    assert (record["tier"], record["admission"]) == ("rt", "unchecked")
    samples = await gw.metrics()
    labels = {"tenant": tenant_id, "outcome": "unchecked", "target": ""}
    assert metric(samples, "tandem_slo_admissions_total", **labels) == 1
