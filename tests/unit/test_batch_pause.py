"""The batch runner's pause (gateway/batch/runner.py): no new line goes to the engine while its
newest report shows RT requests waiting; without a report nothing pauses."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import cast

from aiohttp import web

from backend.policy.batch_order.feed import BatchFeed, FeedSettings
from backend.policy.batch_order.tree import OrderItem
from common.config import Config
from common.wire import EngineLoad
from gateway.batch.execute import ActiveBatch
from gateway.batch.prepare import PreparedLine
from gateway.batch.runner import BatchRunner, be_dispatch_paused
from gateway.batch.store import BatchStore
from gateway.batch.types import BatchInfo, RequestCounts
from gateway.engine.client import EngineClient
from gateway.engine.load import LoadWatcher
from gateway.state import CONFIG, ENGINE, LOADS
from tests.unit.pipeline_factories import chat_body, make_prompt, make_tenant


def load(num_rt_waiting: int, **fields: int) -> EngineLoad:
    return EngineLoad(iteration=7, at_unix_s=100.0, num_rt_waiting=num_rt_waiting, **fields)


def test_lines_pause_while_rt_waits_and_resume_once_it_does_not() -> None:
    assert be_dispatch_paused(load(1))
    assert be_dispatch_paused(load(5, num_be_waiting=3))
    assert not be_dispatch_paused(load(0))  # resumed: the RT queue is empty
    assert not be_dispatch_paused(load(0, num_rt_running=8, num_be_waiting=20))  # RT decoding


def test_without_a_report_nothing_pauses() -> None:
    # no watcher, or the engine's reports are down: the engine's policy still puts RT first
    assert not be_dispatch_paused(None)


async def test_the_runner_sends_no_line_while_rt_waits_then_every_line_once() -> None:
    engine = "http://engine"
    app = web.Application()
    app[CONFIG] = Config()
    app[ENGINE] = cast(EngineClient, SimpleNamespace(base_url=engine))
    watcher = LoadWatcher(engine)
    app[LOADS] = {engine: watcher}
    runner = BatchRunner(app, cast(BatchStore, None))
    sent: list[int] = []

    async def run_line(active: ActiveBatch, line_no: int) -> None:
        sent.append(line_no)  # instead of the engine: what was sent, in order

    runner._run_line = run_line  # type: ignore[method-assign]
    active = _batch(lines=3)
    runner._active[active.info.id] = active

    watcher.update(EngineLoad(iteration=1, at_unix_s=time.time(), num_rt_waiting=2))
    runner._dispatch()  # synchronous: a line it sent would be a task in active.tasks now
    assert sent == [] and not active.tasks  # paused: nothing sent, nothing lost
    watcher.update(EngineLoad(iteration=2, at_unix_s=time.time(), num_rt_waiting=0))
    runner._dispatch()
    await asyncio.gather(*active.tasks.values())
    assert sorted(sent) == [0, 1, 2]  # every line, once, after the RT queue emptied


def _batch(lines: int) -> ActiveBatch:
    now = datetime.now(UTC)
    info = BatchInfo(
        id="batch_1",
        tenant_id="ten_be",
        key_id=None,
        input_file_id="file_1",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        status="in_progress",
        model="tandem-tiny",
        output_file_id=None,
        error_file_id=None,
        errors=None,
        metadata=None,
        request_counts=RequestCounts(total=lines),
        prompt_tokens=0,
        completion_tokens=0,
        deadline_at=now + timedelta(hours=1),
        created_at=now,
        in_progress_at=now,
        expires_at=now + timedelta(hours=24),
        finalizing_at=None,
        completed_at=None,
        failed_at=None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
    )
    items = [
        OrderItem(index=n, path=[n + 1, 7], prompt_len=2, max_output_len=4) for n in range(lines)
    ]
    return ActiveBatch(
        info=info,
        tenant=make_tenant("be"),
        kind="chat",
        feed=BatchFeed(items, FeedSettings(pilot_fraction=0.0, pilot_max_lines=0)),
        prepared={n: PreparedLine(chat_body(), make_prompt(2, 4)) for n in range(lines)},
        custom_ids={n: f"line-{n}" for n in range(lines)},
    )
