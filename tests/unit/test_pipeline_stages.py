"""The request pipeline's stages on a scripted engine: every way a request can end gives the
client one typed outcome and leaves exactly one usage record that says what the client got, with
the quota given back and unfinished engine work aborted."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gateway.engine.client import EngineRequestError, EngineUnavailable
from gateway.errors import ApiError
from gateway.pipeline.outcome import Failure, Refused
from gateway.pipeline.stages import Completion, admit, complete, place, prepare, recording, run
from gateway.state import BACKGROUND
from gateway.store.types import Quota
from tests.unit.pipeline_factories import (
    FakeEngine,
    chat_body,
    chunk,
    fails_with,
    hangs_after,
    make_app,
    make_flight,
    make_principal,
    make_prompt,
    make_request,
    make_tenant,
    replies,
    usage_of,
)

WHOLE = replies(chunk("Hel", 1), chunk("lo", 2), chunk("!", 3, finish="length"))


async def run_to_end(app: web.Application, origin: str = "api") -> Completion | Failure:
    """A prepared request through admit → place → run → record, as the batch runner drives it."""
    flight = make_flight(make_principal(), origin)
    with recording(app, flight):
        flight.request = make_request(flight.principal)
        result = await complete(app, flight)
    return result


async def test_a_complete_answer_is_recorded_ok_and_gives_the_quota_back() -> None:
    app = make_app(FakeEngine(WHOLE))
    tenant = make_tenant("rt", quota=Quota(max_concurrent=1))
    for _ in range(2):  # the second is admitted only if the first gave its slot back
        flight = make_flight(make_principal(tenant))
        with recording(app, flight):
            flight.request = make_request(flight.principal)
            result = await complete(app, flight)
        assert result == Completion(
            text="Hello!", finish_reason="length", prompt_tokens=4, completion_tokens=3
        )
    record = usage_of(app).records[0]
    assert (record.status, record.http_status, record.error) == ("ok", 200, None)
    assert record.endpoint == "chat" and record.tier == "rt" and record.slo_met is True
    assert record.completion_tokens == 3 and record.queue_ms == pytest.approx(2.0)
    assert usage_of(app).length_keys[0] == tenant.id  # feeds the output-length history


@pytest.mark.parametrize(
    ("script", "kind", "status", "code", "retryable"),
    [
        (
            fails_with(EngineUnavailable("engine unreachable")),
            "engine_unavailable",
            503,
            "engine_unavailable",
            True,
        ),
        (fails_with(EngineRequestError("bad stop")), "engine_error", 400, "engine_error", False),
        (replies(chunk("a", 1)), "engine_error", 503, "engine_error", True),  # no finish reason
        (
            replies(chunk("a", 1), chunk("", 1, finish="abort")),
            "aborted",
            503,
            "engine_aborted",
            True,
        ),
    ],
)
async def test_engine_failures_are_typed_and_the_record_logs_what_the_client_got(
    script: object, kind: str, status: int, code: str, retryable: bool
) -> None:
    engine = FakeEngine(script)  # type: ignore[arg-type]
    app = make_app(engine)
    failure = await run_to_end(app)
    assert isinstance(failure, Failure) and not isinstance(failure, Refused)
    assert (failure.kind, failure.http_status, failure.code) == (kind, status, code)
    assert failure.retryable is retryable
    [record] = usage_of(app).records
    assert (record.status, record.http_status) == (kind, failure.api_error().status)
    assert record.slo_met is False and usage_of(app).length_keys == [None]


async def test_a_stream_that_ends_early_is_503_for_the_client_and_in_the_record() -> None:
    app = make_app(FakeEngine(replies(chunk("a", 1))))
    failure = await run_to_end(app)
    assert isinstance(failure, Failure)
    error = failure.api_error()
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert usage_of(app).records[0].http_status == 503
    assert usage_of(app).records[0].error == "engine stream ended without a finish reason"


async def test_engine_unavailable_advises_the_configured_retry_after() -> None:
    app = make_app(FakeEngine(fails_with(EngineUnavailable("engine answered 502"))))
    failure = await run_to_end(app)
    assert isinstance(failure, Failure) and failure.retry_after_s == 5
    assert failure.api_error().message == "the inference engine is unavailable; retry later"
    assert usage_of(app).records[0].error == "engine answered 502"  # the engine's own words


async def test_over_quota_is_refused_before_the_engine_with_a_typed_outcome() -> None:
    engine = FakeEngine(WHOLE)
    app = make_app(engine)
    tenant = make_tenant("rt", quota=Quota(requests_per_min=1))
    results = []
    for _ in range(2):
        flight = make_flight(make_principal(tenant))
        with recording(app, flight):
            flight.request = make_request(flight.principal)
            results.append(await complete(app, flight))
    assert isinstance(results[0], Completion)
    refused = results[1]
    assert isinstance(refused, Refused)
    assert (refused.http_status, refused.code) == (429, "requests_per_min_exceeded")
    assert refused.retryable and refused.retry_after_s is not None and refused.retry_after_s >= 1
    assert len(engine.payloads) == 1  # the refused one never reached the engine
    record = usage_of(app).records[1]
    assert (record.status, record.http_status, record.slo_met) == ("rate_limited", 429, None)
    assert record.prompt_tokens == 4


async def test_batch_lines_are_read_whole_from_the_engine_and_api_requests_stream() -> None:
    engine = FakeEngine(WHOLE)
    app = make_app(engine)
    tenant = make_tenant("be", deadline_s=3600)
    for origin in ("batch", "api"):
        flight = make_flight(make_principal(tenant), origin=origin)
        with recording(app, flight):
            prepare(app, flight, chat_body(), make_prompt())
            assert isinstance(await complete(app, flight), Completion)
    assert engine.streamed == [False, True]


async def test_batch_lines_count_toward_the_monthly_budget_only() -> None:
    app = make_app(FakeEngine(WHOLE))
    tenant = make_tenant("be", quota=Quota(requests_per_min=1), deadline_s=3600)
    for _ in range(3):
        flight = make_flight(make_principal(tenant), origin="batch")
        with recording(app, flight):
            prepare(app, flight, chat_body(tier="rt"), make_prompt())
            assert isinstance(await complete(app, flight), Completion)
    records = usage_of(app).records
    assert [r.endpoint for r in records] == ["batch/chat"] * 3  # the column's old spelling
    assert {r.tier for r in records} == {"be"}  # a batch line runs BE whatever its body asks


async def test_a_client_gone_mid_stream_is_recorded_once_and_the_engine_request_aborted() -> None:
    engine = FakeEngine(hangs_after(chunk("a", 1)))
    app = make_app(engine)
    flight = make_flight(make_principal())
    started = asyncio.Event()

    async def serve() -> None:
        with recording(app, flight):
            flight.request = make_request(flight.principal)
            assert not isinstance(admit(app, flight), Refused)
            place(app, flight)
            async for _ in run(app, flight):
                started.set()

    task = asyncio.create_task(serve())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.gather(*app[BACKGROUND])
    [record] = usage_of(app).records
    assert (record.status, record.http_status, record.completion_tokens) == (
        "client_disconnected",
        499,
        1,
    )
    assert engine.aborted == [flight.request.rid]  # type: ignore[union-attr]


async def test_a_request_refused_by_prepare_is_recorded_with_its_status() -> None:
    app = make_app(FakeEngine(WHOLE))
    flight = make_flight(make_principal(make_tenant("be", deadline_s=60)))
    with pytest.raises(ApiError), recording(app, flight):
        prepare(app, flight, chat_body(tier="rt"), make_prompt())  # a BE contract: 403
    [record] = usage_of(app).records
    assert (record.status, record.http_status) == ("invalid_request", 403)
    assert record.request_id == flight.request_id and record.slo_met is None


async def test_an_unexpected_error_is_recorded_as_the_500_the_client_gets() -> None:
    app = make_app(FakeEngine(WHOLE))
    flight = make_flight(make_principal())
    with pytest.raises(RuntimeError), recording(app, flight):
        raise RuntimeError("bug")
    assert usage_of(app).records[0].http_status == 500
