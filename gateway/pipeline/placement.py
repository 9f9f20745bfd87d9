"""The place stage: which engine runs a request.

The gateway fronts a pool of engines (gateway/engine/pool.py): `engine_candidates` lists the
engines a request may go to (the replicas that serve now), and `choose_engine` picks one from
them with the router `gateway.router` names (backend/policy/placement.py: the same code the
simulator's pool runs): prefix affinity (the engine whose cache holds the prompt's prefix),
RT to the engine with the most predicted slack against its contract, load. A handle carries the
engine's live state (`load`, the app's `LOADS` watcher for it): the watcher's fields are read,
never polled, here. The router keeps its memory (what it sent where since each engine's last
report, which prefixes went where) in the app (`ROUTER`). With one candidate the choice is
forced, but a router that forecasts (`slo`) still places it: its forecast, with the prefix the
engine's cache holds taken off the prompt (a conversation's history), is the SLO admission's.
The run stage uses only the `Placement`, and the record stage aborts an unfinished request on
the engine it was placed on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
from aiohttp import web

from backend.policy.feasibility import Forecast, SloAsk, TtftFeedbackByEngine
from backend.policy.placement import PlaceAsk, Replica, Router, token_prefix_keys
from gateway.engine.client import EngineClient
from gateway.engine.load import LoadWatcher
from gateway.pipeline.prepare import EngineRequest
from gateway.state import ENGINE, LOADS, POOL, ROUTER, TTFT_FEEDBACK

PREFIX_BLOCK_TOKENS = 64
"""Tokens per block of the prompt prefixes the router tracks (the engines' radix caches match
token by token; a block this size is what a shared system prompt or earlier turn spans)."""


class EngineHandle(msgspec.Struct, frozen=True):
    """One engine the gateway may send requests to."""

    name: str
    """Stable name of the engine (its base URL today), for logs and metrics."""
    client: EngineClient
    load: LoadWatcher | None = None
    """The engine's live state (`latest`, `backlog()`; `sent()` on dispatch); None when the
    engine does not report it (stock SGLang)."""


class Placement(msgspec.Struct, frozen=True):
    """Where one request runs."""

    engine: EngineHandle
    forecast: Forecast | None = None
    """The slo router's forecast of an RT request on that engine (None: not forecast)."""
    cached_tokens: int = 0
    """Prompt tokens that forecast took as held by the engine's prefix cache (the router's
    claim, checked against the engine's own count when the request ends)."""
    remember_keys: tuple[int, ...] = ()
    """The prompt's prefix keys, for the router to remember once it has run (`Router.remember`;
    with one engine nothing is recorded at placement: that keeps it off the admission's path);
    empty: recorded at placement, or nothing to record."""


def engine_candidates(app: web.Application) -> list[EngineHandle]:
    """The engines a request may be placed on: one handle per replica of the pool that serves
    now (`EnginePool.serving`: up, and not suspected since its last good probe), with its own
    client and live state. When none serves, the suspected ones that are not known down, else
    every replica: the request then fails the way an engine that is down fails it (503
    `engine_unavailable`), as with one engine.
    An app without a pool (unit tests' minimal apps) has the one engine of `ENGINE`."""
    loads = app.get(LOADS) or {}
    pool = app.get(POOL)
    if pool is None:
        client = app[ENGINE]
        return [EngineHandle(name=client.base_url, client=client, load=loads.get(client.base_url))]
    # none serves: those only a request suspects before those known down, then every one
    replicas = pool.serving() or [r for r in pool.replicas if r.health.is_up] or pool.replicas
    return [
        EngineHandle(name=r.name, client=r.require_client(), load=loads.get(r.name))
        for r in replicas
    ]


def place_request(
    app: web.Application,
    request: EngineRequest,
    slo: SloAsk | None,
    now_unix_s: float,
    avoid: str | None = None,
) -> Placement | None:
    """The app's placement of *request* (*slo*: what it asks, if RT with a target) among the
    engines that serve now (`engine_candidates`), by the app's router (`ROUTER`) with what each
    engine's outcomes taught (`TTFT_FEEDBACK`); *avoid*: an engine's name not to place it on.
    None when that leaves no engine."""
    candidates = [h for h in engine_candidates(app) if h.name != avoid]
    if not candidates:
        return None
    return decide(request, candidates, app.get(ROUTER), slo, now_unix_s, app.get(TTFT_FEEDBACK))


def choose_engine(
    request: EngineRequest,
    candidates: Sequence[EngineHandle],
    router: Router | None = None,
    slo: SloAsk | None = None,
    now_unix_s: float | None = None,
) -> EngineHandle:
    """The engine to run *request* on, among *candidates* (at least one). With one engine, or
    without a router, the choice is forced (the first); else *router* ranks the candidates by
    their live state (`decide`; with one engine too when it forecasts)."""
    return decide(request, candidates, router, slo, now_unix_s).engine


def decide(
    request: EngineRequest,
    candidates: Sequence[EngineHandle],
    router: Router | None,
    slo: SloAsk | None = None,
    now_unix_s: float | None = None,
    feedback: TtftFeedbackByEngine | None = None,
) -> Placement:
    """`choose_engine`'s placement; *slo*: what an RT request asks (`admission.slo_ask`), for
    the slo router to forecast — its forecast on the engine chosen is `Placement.forecast`
    (infeasible when no candidate was predicted to meet the contract); *feedback*: what each
    engine's own outcomes taught its TTFT forecast."""
    if not candidates:
        raise ValueError("no engine to place the request on")
    if router is None or (len(candidates) == 1 and not router.forecasts):
        return Placement(engine=candidates[0])
    now = time.time() if now_unix_s is None else now_unix_s
    ask = PlaceAsk(
        tier=request.meta.tier,
        prompt_tokens=len(request.input_ids),
        prefix_keys=token_prefix_keys(request.input_ids, PREFIX_BLOCK_TOKENS),
        block_tokens=PREFIX_BLOCK_TOKENS,
        slo=slo,
    )
    if len(candidates) == 1:  # nothing to choose: the forecast alone, recorded once it ran
        only = candidates[0]
        decision = router.forecast_alone(ask, _replica(only, now, feedback))
        return Placement(
            engine=only,
            forecast=decision.forecast,
            cached_tokens=decision.cached_tokens,
            remember_keys=ask.prefix_keys,
        )
    decision = router.choose(ask, [_replica(h, now, feedback) for h in candidates])
    return Placement(
        engine=candidates[decision.index],
        forecast=decision.forecast,
        cached_tokens=decision.cached_tokens,
    )


def _replica(
    handle: EngineHandle, now_unix_s: float, feedback: TtftFeedbackByEngine | None
) -> Replica:
    """The router's view of an engine: its latest report, the RT sent to it since, and what
    its outcomes taught its TTFT forecast."""
    watcher = handle.load
    extra_s = feedback.extra_s(handle.name, now_unix_s) if feedback is not None else 0.0
    scale = feedback.slot_wait_scale(handle.name, now_unix_s) if feedback is not None else 1.0
    if watcher is None or watcher.latest is None:
        return Replica(name=handle.name, load=None, ttft_extra_s=extra_s, slot_wait_scale=scale)
    return Replica(
        name=handle.name,
        load=watcher.latest,
        backlog=watcher.backlog(now_unix_s),
        ttft_extra_s=extra_s,
        slot_wait_scale=scale,
    )
