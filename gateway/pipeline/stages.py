"""One request's route through the gateway — the same for a client's HTTP call and a batch line:

    parse → prepare → admit → place → run → record

=======  ==========================================================================================
parse    the body's bytes → the endpoint's request Struct, type- and range-checked
prepare  the Struct → an `EngineRequest`: prompt tokens, output cap, tier, scheduler metadata
admit    the admission checks → `Admitted` (with what they hold) or `Refused` (status, code,
         retryable, retry_after_s) — gateway/pipeline/admission.py; an RT request refused only
         for a request slot waits for the engine's next reports, judged again on each
         (`admit_rechecking`)
place    the engine that runs it → `Placement` — gateway/pipeline/placement.py
run      drives the engine's stream; an engine failure ends it with a typed `Failure`
         (gateway/pipeline/outcome.py) on the flight, not an exception
record   exactly once, however the request ended: stops the engine's work if it is unfinished,
         gives back the admission holds, writes the usage record (and the output length to the
         tenant's history) and counts the metrics
=======  ==========================================================================================

A `Flight` carries what the stages learn about one request. `recording` wraps its whole life and
runs record when it ends — answered, refused, failed, client gone or task cancelled. `complete`
runs admit → place → run and collects the answer (a non-streamed response, a batch line); a
streamed response calls the same three stages itself, to send each chunk as it comes. The
callers only add their framing: gateway/api/openai.py (JSON or server-sent events) and
gateway/batch/execute.py (a row of the batch's table, a retry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from aiohttp import web

from backend.policy.feasibility import mean_iteration_s
from backend.policy.placement import CLAIM_HELD_FRAC
from common.wire import EngineLoad, Tier
from gateway.api.schemas import ChatCompletionRequest, Endpoint, OpenAIRequest
from gateway.auth import Principal
from gateway.engine.client import (
    EngineChunk,
    EngineRequestError,
    EngineUnavailable,
    TokenLogprob,
)
from gateway.errors import ApiError
from gateway.pipeline.admission import (
    Admitted,
    Origin,
    Pending,
    admission_checks,
    admit_through,
    release_holds,
    slo_ask,
)
from gateway.pipeline.admission_log import engine_state
from gateway.pipeline.outcome import (
    UNJUDGED,
    Failure,
    Refused,
    client_disconnected,
    engine_aborted,
    engine_rejected,
    engine_unavailable,
    internal_error,
    invalid_request,
    stream_ended_early,
)
from gateway.pipeline.placement import Placement, engine_candidates, place_request
from gateway.pipeline.prepare import (
    EngineRequest,
    PreparedPrompt,
    build_engine_request,
    new_rid,
    parse_body,
    prepare_prompt,
    resolve_tier,
)
from gateway.quotas.limiter import LimitStatus
from gateway.slo import RequestTimer, slo_met
from gateway.state import (
    CONFIG,
    METRICS,
    POOL,
    QUOTAS,
    ROUTER,
    SLOT_LINE,
    TOKENIZER,
    TTFT_FEEDBACK,
    USAGE,
    spawn,
)
from gateway.store.types import AdmissionOutcome, UsageRecord

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What the engine has reported about a request so far."""

    prompt_tokens: int = 0
    """The prompt's length, tokens (the engine's count once it reports one)."""
    completion_tokens: int = 0
    queue_ms: float | None = None
    """Time the request waited in the engine's queue, ms."""
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache (its count)."""
    finish_reason: str | None = None
    """The engine's: "stop", "length" or "abort"; None until the last chunk."""

    @property
    def is_finished(self) -> bool:
        """Whether the engine ended the generation (so there is nothing left to abort)."""
        return self.finish_reason is not None


@dataclass
class Flight:
    """One request's passage through the pipeline: what the stages have learned about it."""

    principal: Principal
    origin: Origin
    endpoint: Endpoint
    model: str
    """The served model's id (the usage record's `model`)."""
    request_id: str = field(default_factory=new_rid)
    """The request's id: its response's `x-request-id` (gateway/request_id.py), its engine
    request's `rid` and its usage record's `request_id`, whether it ran or not."""
    stream: bool = False
    """Whether the client asked for a streamed answer (known once parsed)."""
    timer: RequestTimer = field(default_factory=RequestTimer)
    """Started when the request arrived: TTFT and end-to-end time count from here."""
    arrival_unix_s: float = field(default_factory=time.time)
    """When the request arrived, wall clock (the SLO admission's `waited_s` counts from it)."""
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    request: EngineRequest | None = None
    """Set by prepare; admission may change its terms."""
    admitted: Admitted | None = None
    admission: AdmissionOutcome | None = None
    """The SLO admission's verdict (None: it did not judge the request)."""
    slo_rechecks: int = 0
    """Reports of the engine the request waited for at the gateway before the SLO admission's
    verdict (`admit_rechecking`); 0: judged on arrival."""
    placement: Placement | None = None
    progress: Progress = field(default_factory=Progress)
    first_token_load: EngineLoad | None = None
    """Its engine's latest report when its first token arrived (None: no token yet, or no
    report): with the one the SLO admission judged on, how fast the engine's iterations ran
    while it waited (`TtftFeedback.observe`)."""
    failure: Failure | None = None
    """Why it did not complete; None while it runs, and for a complete answer."""
    recorded: bool = False

    def fail(self, failure: Failure) -> None:
        """Marks the request failed; the first failure is the one the client got, so it wins."""
        if self.failure is None:
            self.failure = failure


@dataclass(frozen=True)
class Completion:
    """A whole answer (the run collected to its end)."""

    text: str
    finish_reason: str
    """The engine's: "stop" or "length"."""
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Each output token's log probability, when the request asked for them."""
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache."""


# ---------------------------------------------------------------------------------- the stages


def parse(app: web.Application, flight: Flight, raw: bytes) -> OpenAIRequest:
    """parse: the request Struct of *raw* (400 / 422 ApiError naming the field otherwise)."""
    body = parse_body(
        raw,
        flight.endpoint,
        app[CONFIG].model.name,
        declares_tools=app[TOKENIZER].declares_tools,
    )
    flight.stream = body.stream
    return body


def prepare(
    app: web.Application, flight: Flight, body: OpenAIRequest, prompt: PreparedPrompt | None = None
) -> EngineRequest:
    """prepare: the engine request of *body* (ApiError naming the field when it cannot run).

    *prompt* is the body's prompt when it was tokenized already (the batch runner tokenizes a
    batch's lines when it loads it, to order them). Batch lines run as BE whatever their body
    asks: a batch is best-effort work by definition."""
    if prompt is None:
        prompt = prepare_prompt(body, app[TOKENIZER], app[CONFIG].gateway.default_max_tokens)
    tenant = flight.principal.tenant
    tier: Tier = "be" if flight.origin == "batch" else resolve_tier(tenant, body.tier)
    flight.request = build_engine_request(
        body,
        prompt.input_ids,
        prompt.max_tokens,
        flight.principal,
        tier,
        arrival_unix_s=flight.arrival_unix_s,
        rid=flight.request_id,
        tool_family=app[TOKENIZER].tool_family if _has_tools(body) else None,
    )
    return flight.request


def _has_tools(body: OpenAIRequest) -> bool:
    return isinstance(body, ChatCompletionRequest) and bool(body.tools)


async def admit_rechecking(app: web.Application, flight: Flight) -> Admitted | Refused:
    """admit, where an RT request the SLO admission would refuse (or downgrade) only for a
    request slot's wait waits at the gateway for the engine's next reports, judged again on
    each, for at most `gateway.slo_recheck_frac` of its TTFT target from its arrival
    (`SloCheck.recheck`); then the verdict is final. The checks before the SLO check (the
    quota) run once: what they hold is kept while it waits, and given back if it is
    cancelled."""
    assert flight.request is not None, "prepare runs before admit"
    config = app.get(CONFIG)
    meta = flight.request.meta
    frac = config.gateway.slo_recheck_frac if config is not None else 0.0
    if frac <= 0.0 or meta.tier != "rt" or meta.ttft_target_ms is None:
        return admit(app, flight)
    until_unix_s = meta.arrival_unix_s + frac * meta.ttft_target_ms / 1000.0
    candidate, first = _candidate(flight), 0
    line = app.get(SLOT_LINE)
    try:
        while True:
            left_s = until_unix_s - time.time()
            checks = admission_checks(app, recheck=left_s > 0.0)
            verdict = admit_through(checks[first:], candidate)
            if not isinstance(verdict, Pending):
                break
            assert verdict.admitted is not None
            candidate, first = verdict.admitted, first + verdict.resume_at
            flight.slo_rechecks += 1
            if line is not None:  # later arrivals that would wait for a slot wait behind it
                line.join(flight.request_id, verdict.engine, meta.arrival_unix_s)
            try:
                await verdict.next_report(left_s)
            except BaseException:
                release_holds(candidate.holds, used_tokens=0)
                raise
    finally:
        if line is not None:
            line.leave(flight.request_id)
    outcome = _settled(app, flight, verdict)
    if flight.slo_rechecks:
        label = flight.admission or ("admitted" if isinstance(outcome, Admitted) else "refused")
        app[METRICS].slo_rechecked(flight.principal.tenant.id, label)
    return outcome


def admit(app: web.Application, flight: Flight) -> Admitted | Refused:
    """admit: runs the admission checks on the prepared request (the verdict is final)."""
    verdict = admit_through(admission_checks(app), _candidate(flight))
    assert not isinstance(verdict, Pending), "only a rechecking SLO check answers Pending"
    return _settled(app, flight, verdict)


def _candidate(flight: Flight) -> Admitted:
    assert flight.request is not None, "prepare runs before admit"
    flight.progress.prompt_tokens = len(flight.request.input_ids)
    return Admitted(tenant=flight.principal.tenant, origin=flight.origin, request=flight.request)


def _settled(
    app: web.Application, flight: Flight, outcome: Admitted | Refused
) -> Admitted | Refused:
    """The flight takes the admission's final verdict."""
    if isinstance(outcome, Refused):
        if outcome.kind == "slo_unattainable":
            flight.admission = "shed"
        flight.fail(outcome)
        return outcome
    flight.admission = outcome.slo.outcome if outcome.slo is not None else None
    flight.admitted = outcome
    flight.request = outcome.request
    app[METRICS].request_started(outcome.tenant.id, outcome.request.meta.tier)
    return outcome


DOWNGRADED_HEADER = "X-Tandem-Downgraded"
"""Response header of a request the SLO admission ran as BE instead of RT; its value names the
target the forecast said RT would miss ("ttft" or "tpot")."""


def response_headers(app: web.Application, flight: Flight) -> dict[str, str]:
    """The headers the admission adds to a successful response: the tenant's per-minute limits
    as they stand now (OpenAI's `x-ratelimit-*`, each only for a limit the tenant has), and a
    downgrade's `X-Tandem-Downgraded`."""
    admitted = flight.admitted
    headers: dict[str, str] = {}
    quotas = app.get(QUOTAS)
    if quotas is not None and admitted is not None:
        requests, tokens = quotas.limit_status(admitted.tenant.id)
        headers.update(rate_limit_headers("requests", requests))
        headers.update(rate_limit_headers("tokens", tokens))
    if admitted is not None and admitted.slo is not None and admitted.slo.outcome == "downgraded":
        headers[DOWNGRADED_HEADER] = admitted.slo.target
    return headers


def rate_limit_headers(unit: str, status: LimitStatus | None) -> dict[str, str]:
    """`x-ratelimit-{limit,remaining,reset}-<unit>` of one limit (none without the limit)."""
    if status is None:
        return {}
    return {
        f"x-ratelimit-limit-{unit}": str(status.limit),
        f"x-ratelimit-remaining-{unit}": str(status.remaining),
        f"x-ratelimit-reset-{unit}": duration_text(status.reset_s),
    }


def duration_text(seconds: float) -> str:
    """A duration as OpenAI's reset headers spell it: "250ms", "1.5s", "6m0s"."""
    if seconds < 1.0:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def place(app: web.Application, flight: Flight, *, avoid: str | None = None) -> Placement | None:
    """place: the engine the admitted request runs on; *avoid*: an engine's name not to place
    it on (None when that leaves no engine)."""
    assert flight.admitted is not None, "admit runs before place"
    request = flight.admitted.request
    judged = flight.admitted.placement  # the engine the SLO admission judged it on
    if (
        judged is not None
        and avoid is None
        and any(h.name == judged.engine.name for h in engine_candidates(app))
    ):
        flight.placement = judged
        return judged
    now_unix_s = time.time()
    placement = place_request(app, request, slo_ask(request, now_unix_s), now_unix_s, avoid)
    if placement is not None:  # none left: the one it was placed on stays its engine
        flight.placement = placement
    return placement


async def run(app: web.Application, flight: Flight) -> AsyncGenerator[EngineChunk, None]:
    """run: the engine's chunks of the placed request, timed as they arrive. An engine failure,
    a stream that ends without a finish reason, or an engine abort ends the stream with
    `flight.failure` set (an abort's last chunk is still yielded: it may carry text).

    An engine that never took the request (unreachable: a replica that just died) is out of
    placement at once, and the request is placed again, once, on another engine of the pool
    if one serves: nothing ran yet, so nothing runs twice."""
    request, placement = flight.request, flight.placement
    assert request is not None and placement is not None, "place runs before run"
    progress = flight.progress
    stream = flight.origin != "batch"  # a batch line is read whole: one answer at the end
    replaced = False
    last: EngineChunk | None = None
    while True:
        received = False
        try:
            # aclosing: a consumer that stops early (client gone) closes the engine's stream
            generation = placement.engine.client.generate(request.payload, stream=stream)
            async with contextlib.aclosing(generation) as chunks:
                async for chunk in chunks:
                    received = True
                    if flight.timer.tokens == 0 < chunk.completion_tokens:
                        watcher = placement.engine.load
                        flight.first_token_load = watcher.latest if watcher is not None else None
                    flight.timer.on_tokens(chunk.completion_tokens)
                    progress.completion_tokens = chunk.completion_tokens
                    progress.prompt_tokens = chunk.prompt_tokens or progress.prompt_tokens
                    progress.cached_tokens = max(progress.cached_tokens, chunk.cached_tokens)
                    if chunk.queue_time_s is not None:
                        progress.queue_ms = chunk.queue_time_s * 1000.0
                    if chunk.finish_reason is not None:
                        progress.finish_reason = chunk.finish_reason
                    last = chunk
                    yield chunk
        except EngineUnavailable as exc:
            pool = app.get(POOL)
            if pool is not None:  # out of placement at once, not at the next probe
                pool.suspect(placement.engine.name)
            if not (exc.is_lost or received or replaced):
                elsewhere = place(app, flight, avoid=placement.engine.name)
                if elsewhere is not None:
                    placement, replaced = elsewhere, True
                    continue
            retry_after_s = app[CONFIG].gateway.engine_retry_after_s
            flight.fail(engine_unavailable(str(exc), retry_after_s, is_engine_lost=exc.is_lost))
            return
        except EngineRequestError as exc:
            flight.fail(engine_rejected(str(exc)))
            return
        break
    if not progress.is_finished:
        flight.fail(stream_ended_early())
    elif progress.finish_reason == "abort":
        flight.fail(_abort_failure(last))


OPERATOR_ABORT_MESSAGE = "Aborted by AbortReq."
"""SGLang's message for a request aborted through its /abort_request (by the gateway, whose
client went away, or by an operator): the request was not at fault."""


def _abort_failure(last: EngineChunk | None) -> Failure:
    """The failure of a generation the engine aborted: a 400 with the engine's reason when
    the request itself cannot run (SGLang's 400 aborts: a response_format schema whose grammar
    does not compile, a prompt beyond its KV pool) — retrying would not help —; otherwise a
    503 to retry (evicted, or an operator's abort)."""
    if (
        last is not None
        and last.abort_status == 400
        and last.abort_message
        and last.abort_message != OPERATOR_ABORT_MESSAGE
    ):
        return engine_rejected(last.abort_message)
    return engine_aborted()


def record(app: web.Application, flight: Flight, *, cancelled: bool) -> None:
    """record: the end of a request, whatever it was; call exactly once (`recording` does).
    *cancelled*: the client went away (or the batch line's task was cancelled)."""
    assert not flight.recorded, "a request is recorded once"
    flight.recorded = True
    progress = flight.progress
    if cancelled and not progress.is_finished:
        flight.fail(client_disconnected())
    if flight.placement is not None and flight.request is not None and not progress.is_finished:
        # the engine may still be generating for nobody: free its KV now
        spawn(app, flight.placement.engine.client.abort(flight.request.rid))
    flight.timer.finish()
    if flight.admitted is not None:
        # a request that produced nothing (refused by the engine, never reached it) cost nothing;
        # work a shutdown cut off is not billed either (its batch line runs again)
        ran = progress.completion_tokens > 0 or flight.failure is None
        billed = flight.failure is None or flight.failure.kind != "interrupted"
        used = progress.prompt_tokens + progress.completion_tokens if ran and billed else 0
        release_holds(flight.admitted.holds, used)
    usage = usage_record(flight)
    cache_claim_held = _teach_prefix_memory(app, flight)
    if cache_claim_held:
        _teach_forecast(app, flight, usage)
    if usage.slo_met is False:
        _log_admitted_miss(flight, usage)
    meta = flight.request.meta if flight.request is not None else None
    length_key = meta.length_key if meta is not None and flight.failure is None else None
    app[METRICS].request_finished(usage, started=flight.admitted is not None)
    app[USAGE].record(usage, length_key=length_key, key_id=flight.principal.key_id)


def _teach_prefix_memory(app: web.Application, flight: Flight) -> bool:
    """A request whose forecast took part of its prompt as cached on its engine tells the
    router how much the engine really held (`Router.observe_cached`); False when the engine
    held less than claimed. Its TTFT then says nothing about the engine's pace — the engine
    computed what the forecast left out —, so it does not teach the TTFT feedback: taught,
    a few such misses made the admission refuse every request for a while (multi-turn chats
    on the CPU engine: 40 of 40 turns refused beside a batch)."""
    placement = flight.placement
    router = app.get(ROUTER)
    if placement is None or router is None or flight.progress.completion_tokens <= 0:
        return True  # never prefilled: nothing learned
    if placement.remember_keys:  # its engine computed the prompt: its cache holds it now
        router.remember(placement.engine.name, placement.remember_keys)
    if placement.cached_tokens <= 0:
        return True
    cached = flight.progress.cached_tokens
    router.observe_cached(placement.cached_tokens, cached)
    return cached >= CLAIM_HELD_FRAC * placement.cached_tokens


def _teach_forecast(app: web.Application, flight: Flight, usage: UsageRecord) -> None:
    """An RT request the SLO admission admitted on a TTFT forecast, and that got its first
    token, tells the admission how right the forecast was (`TtftFeedback`), and operators
    (`tandem_slo_ttft_forecast_error_seconds`)."""
    feedback = app.get(TTFT_FEEDBACK)
    admitted = flight.admitted
    if feedback is None or admitted is None or usage.ttft_ms is None:
        return
    slo = admitted.slo
    if slo is None or slo.outcome != "admitted" or slo.forecast_ttft_s is None:
        return
    placement = flight.placement
    if slo.engine is None or (placement is not None and placement.engine.name != slo.engine):
        return  # it ran elsewhere (its engine failed): the forecast was for another engine
    observed_s = usage.ttft_ms / 1000.0 - slo.waited_s  # from admission, as forecast
    app[METRICS].slo_ttft_forecast_error.labels(slo.engine).observe(
        observed_s - slo.forecast_ttft_s
    )
    before, after = slo.load, flight.first_token_load
    iteration_s = None
    if before is not None and after is not None:
        iteration_s = mean_iteration_s(
            before.iteration, before.at_unix_s, after.iteration, after.at_unix_s
        )
    feedback.of(slo.engine).observe(
        slo.forecast_ttft_s,
        observed_s,
        time.time(),
        slo.slot_wait_s,
        slo.slot_step_s,
        iteration_s,
    )


def _log_admitted_miss(flight: Flight, usage: UsageRecord) -> None:
    """An RT request the SLO admission admitted on a forecast, and that then missed its
    contract: one INFO line with the forecast, what came, and the engine state the forecast was
    made on — what an operator (or a developer of the forecast) needs to tell a slower engine
    from a forecast that does not see a case. Admitted misses are the rare ones (the admission
    sheds what it forecasts to miss), so this is no per-request log."""
    admitted = flight.admitted
    slo = admitted.slo if admitted is not None else None
    if slo is None or slo.outcome != "admitted" or slo.forecast_ttft_s is None:
        return
    meta = flight.request.meta if flight.request is not None else None
    if meta is None:
        return
    state = ""
    if slo.load is not None:
        state = f"; {engine_state(slo.engine or '', slo.load)}"
    tpot = ""
    if meta.tpot_target_ms is not None:
        forecast_tpot = (
            f"{slo.forecast_tpot_s * 1000:.0f} ms" if slo.forecast_tpot_s is not None else "none"
        )
        got_tpot = f"{usage.tpot_ms:.0f} ms" if usage.tpot_ms is not None else "none"
        tpot = f"; TPOT {got_tpot} (target {meta.tpot_target_ms:.0f} ms, forecast {forecast_tpot})"
    got_ttft = f"{usage.ttft_ms:.0f} ms" if usage.ttft_ms is not None else "none"
    log.info(
        "admitted RT request %s of tenant %s missed its contract: first token after %s "
        "(target %.0f ms; forecast %.0f ms to come after %.0f ms waited, +%.0f ms taught)%s%s",
        usage.request_id,
        usage.tenant_id,
        got_ttft,
        meta.ttft_target_ms or 0.0,
        slo.forecast_ttft_s * 1000,
        slo.waited_s * 1000,
        slo.ttft_extra_s * 1000,
        tpot,
        state,
    )


# ---------------------------------------------------------------------------------- drivers


@contextlib.contextmanager
def recording(app: web.Application, flight: Flight) -> Iterator[Flight]:
    """Runs the record stage once when the block ends, however it ends. An exception that
    escapes the block is what the client gets, so the record says so: an ApiError (parse and
    prepare refuse with one) is an invalid request, anything else an internal error, and a
    cancellation a client that went away."""
    cancelled = False
    try:
        yield flight
    except BaseException as exc:
        cancelled = is_cancellation(exc)
        if not cancelled:
            flight.fail(_failure_of(exc))
        raise
    finally:
        record(app, flight, cancelled=cancelled)


async def complete(app: web.Application, flight: Flight) -> Completion | Failure:
    """admit → place → run for a prepared request, collected into the whole answer (a
    non-streamed response, a batch line); or the failure that ended it."""
    admission = await admit_rechecking(app, flight)
    if isinstance(admission, Refused):
        return admission
    placed = place(app, flight)
    assert placed is not None  # without *avoid* every engine is a candidate
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async with contextlib.aclosing(run(app, flight)) as chunks:
        async for chunk in chunks:
            parts.append(chunk.text_delta)
            logprobs.extend(chunk.logprobs)
    if flight.failure is not None:
        return flight.failure
    progress = flight.progress
    assert progress.finish_reason is not None  # run fails a stream that ends without one
    return Completion(
        text="".join(parts),
        finish_reason=progress.finish_reason,
        prompt_tokens=progress.prompt_tokens,
        completion_tokens=progress.completion_tokens,
        logprobs=logprobs,
        cached_tokens=progress.cached_tokens,
    )


def is_cancellation(exc: BaseException) -> bool:
    """The client went away (handler cancelled, or a write hit a closed connection)."""
    return isinstance(exc, (asyncio.CancelledError, ConnectionResetError))


def usage_endpoint(origin: Origin, endpoint: Endpoint) -> str:
    """The usage record's `endpoint`: "chat", "completions", or "batch/chat", "batch/completions"
    for batch lines (the spelling the usage_records table has always held)."""
    return f"batch/{endpoint}" if origin == "batch" else endpoint


def usage_record(flight: Flight) -> UsageRecord:
    """The usage record of a request that has ended."""
    tenant = flight.principal.tenant
    request, progress, timer, failure = (
        flight.request,
        flight.progress,
        flight.timer,
        flight.failure,
    )
    meta = request.meta if request is not None else None
    tier = meta.tier if meta is not None else tenant.tier
    met = None
    judged = failure is None or failure.kind not in UNJUDGED  # a cancel is no SLO miss
    if meta is not None and flight.admitted is not None and judged:  # only what ran is judged
        met = slo_met(
            tier=tier,
            ttft_target_ms=meta.ttft_target_ms,
            tpot_target_ms=meta.tpot_target_ms,
            deadline_s=meta.deadline_s,
            ok=failure is None,
            ttft_ms=timer.ttft_ms,
            tpot_ms=timer.tpot_ms,
            e2e_ms=timer.e2e_ms,
        )
    return UsageRecord(
        request_id=flight.request_id,
        tenant_id=tenant.id,
        key_id=flight.principal.key_id,
        tier=tier,
        model=flight.model,
        endpoint=usage_endpoint(flight.origin, flight.endpoint),
        stream=flight.stream,
        prompt_tokens=progress.prompt_tokens,
        completion_tokens=progress.completion_tokens,
        queue_ms=progress.queue_ms,
        ttft_ms=timer.ttft_ms,
        tbt_max_ms=timer.tbt_max_ms,
        tpot_ms=timer.tpot_ms,
        e2e_ms=timer.e2e_ms,
        status=failure.kind if failure is not None else "ok",
        http_status=failure.http_status if failure is not None else 200,
        error=failure.record_error if failure is not None else None,
        slo_met=met,
        admission=flight.admission,
        engine=flight.placement.engine.name if flight.placement is not None else None,
        created_at=flight.created_at,
        finished_at=datetime.now(UTC),
    )


def _failure_of(exc: BaseException) -> Failure:
    """The failure of a request whose handling raised *exc* (what the client gets from it)."""
    if isinstance(exc, ApiError):
        return invalid_request(exc)
    if isinstance(exc, web.HTTPException) and exc.status >= 400:  # e.g. a body over the limit
        return invalid_request(ApiError(exc.status, exc.reason or "request failed"))
    return internal_error()
