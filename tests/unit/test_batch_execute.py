"""The batch runner settles a line that did not complete from its typed outcome: a failure
retrying cannot fix goes to the error file at once; an engine that is down only delays the line;
any other retryable failure costs an attempt, up to `batch.max_attempts`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from common.config import BatchConfig
from gateway.batch.execute import ActiveBatch, settle_failure
from gateway.batch.types import ItemResult
from gateway.errors import ApiError
from gateway.pipeline.outcome import (
    engine_aborted,
    engine_unavailable,
    invalid_request,
    stream_ended_early,
)
from tests.unit.pipeline_factories import make_tenant


class LineStore:
    """The two writes settle_failure makes."""

    def __init__(self) -> None:
        self.finished: dict[int, ItemResult] = {}
        self.requeued: list[int] = []

    async def finish_item(self, batch_id: str, line_no: int, result: ItemResult) -> None:
        self.finished[line_no] = result

    async def requeue_item(self, batch_id: str, line_no: int) -> None:
        self.requeued.append(line_no)


def active_batch() -> ActiveBatch:
    info: Any = SimpleNamespace(id="batch_1")
    return ActiveBatch(
        info=info,
        tenant=make_tenant("be"),
        kind="chat",
        feed=None,  # type: ignore[arg-type]
        prepared={},
        custom_ids={},
    )


CFG = BatchConfig(max_attempts=2)


async def test_a_failure_retrying_cannot_fix_goes_to_the_error_file_at_once() -> None:
    store, active = LineStore(), active_batch()
    failure = invalid_request(ApiError(400, "prompt too long", param="messages"))
    await settle_failure(store, CFG, active, 7, failure)  # type: ignore[arg-type]
    response = store.finished[7].response
    assert response is not None and response["status_code"] == 400
    assert response["body"]["error"]["param"] == "messages" and store.requeued == []


async def test_an_engine_that_is_down_delays_a_line_without_costing_attempts() -> None:
    store, active = LineStore(), active_batch()
    for _ in range(5):
        await settle_failure(store, CFG, active, 1, engine_unavailable("down", 5))  # type: ignore[arg-type]
    assert store.requeued == [1] * 5 and store.finished == {}
    assert active.down_streak == 5 and len(active.retry) == 5


async def test_other_retryable_failures_cost_attempts_up_to_the_limit() -> None:
    store, active = LineStore(), active_batch()
    await settle_failure(store, CFG, active, 3, engine_aborted())  # type: ignore[arg-type]
    assert store.requeued == [3]
    await settle_failure(store, CFG, active, 3, stream_ended_early())  # type: ignore[arg-type]
    result = store.finished[3]
    assert result.status == "failed" and result.response is not None
    assert result.response["status_code"] == 503
    assert result.response["body"]["error"]["code"] == "engine_error"
