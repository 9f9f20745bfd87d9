"""The batch runner settles a line that did not complete from its typed outcome: a failure
retrying cannot fix goes to the error file at once; an engine that is down only delays the line
(its attempt is given back); any other retryable failure — an engine that went away with the
line among them — keeps its attempt (counted in SQL at dispatch), up to `batch.max_attempts`."""

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
    internal_error,
    invalid_request,
    stream_ended_early,
)
from tests.unit.pipeline_factories import make_tenant


class LineStore:
    """The two writes settle_failure makes."""

    def __init__(self) -> None:
        self.finished: dict[int, ItemResult] = {}
        self.requeued: list[int] = []
        self.refunded: list[int] = []
        """Requeued lines whose attempt was given back (the engine never had them)."""

    async def finish_item(self, batch_id: str, line_no: int, result: ItemResult) -> None:
        self.finished[line_no] = result

    async def requeue_item(
        self, batch_id: str, line_no: int, *, is_attempt_refunded: bool = False
    ) -> None:
        self.requeued.append(line_no)
        if is_attempt_refunded:
            self.refunded.append(line_no)


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
    await settle_failure(store, CFG, active, 7, failure, attempt=1)  # type: ignore[arg-type]
    response = store.finished[7].response
    assert response is not None and response["status_code"] == 400
    assert response["body"]["error"]["param"] == "messages" and store.requeued == []


async def test_an_engine_that_is_down_delays_a_line_without_costing_attempts() -> None:
    store, active = LineStore(), active_batch()
    for _ in range(5):  # the attempt given back each time: the line's count stays at 1
        await settle_failure(store, CFG, active, 1, engine_unavailable("down", 5), attempt=1)  # type: ignore[arg-type]
    assert store.requeued == [1] * 5 and store.refunded == [1] * 5 and store.finished == {}
    assert active.down_streak == 5 and len(active.retry) == 5


async def test_other_retryable_failures_cost_attempts_up_to_the_limit() -> None:
    store, active = LineStore(), active_batch()
    await settle_failure(store, CFG, active, 3, engine_aborted(), attempt=1)  # type: ignore[arg-type]
    assert store.requeued == [3] and store.refunded == []
    await settle_failure(store, CFG, active, 3, stream_ended_early(), attempt=2)  # type: ignore[arg-type]
    result = store.finished[3]
    assert result.status == "failed" and result.response is not None
    assert result.response["status_code"] == 503
    assert result.response["body"]["error"]["code"] == "engine_error"


async def test_an_engine_lost_with_the_line_costs_attempts_and_ends_it_with_the_reason() -> None:
    store, active = LineStore(), active_batch()
    lost = engine_unavailable("engine lost: ServerDisconnectedError", 5, is_engine_lost=True)
    await settle_failure(store, CFG, active, 4, lost, attempt=1)  # type: ignore[arg-type]
    assert store.requeued == [4] and store.refunded == [] and store.finished == {}
    assert active.down_streak == 1  # the engine is likely restarting: back off as when down
    await settle_failure(store, CFG, active, 4, lost, attempt=2)  # type: ignore[arg-type]
    result = store.finished[4]
    assert result.status == "failed" and result.response is not None
    assert result.response["status_code"] == 500
    error = result.response["body"]["error"]
    assert error["code"] == "batch_attempts_exhausted" and "2 attempts" in error["message"]


async def test_a_failure_before_the_attempt_was_counted_only_retries() -> None:
    store, active = LineStore(), active_batch()
    await settle_failure(store, CFG, active, 5, internal_error(), attempt=0)  # type: ignore[arg-type]
    assert store.requeued == [5] and store.refunded == [] and store.finished == {}
