"""The place stage: which engine runs a request.

The gateway fronts a pool of engines (gateway/engine/pool.py): `engine_candidates` lists the
engines a request may go to (the replicas that serve now), and `choose_engine` picks one
from them for a given request — a pure function of the request and the candidates' handles, the
place for prefix affinity (the engine whose cache holds the prompt's prefix), tier headroom (RT
to the engine with the most slack) and load. A handle carries the engine's live state
(`load`, the app's `LOADS` watcher for it), so ranking by load stays a pure function of the
handles: the watcher's fields are read, never polled, there. The run stage uses only the
`Placement`, and the record stage aborts an unfinished request on the engine it was placed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from gateway.engine.client import EngineClient
from gateway.engine.load import LoadWatcher
from gateway.pipeline.prepare import EngineRequest
from gateway.state import ENGINE, LOADS, POOL


@dataclass(frozen=True)
class EngineHandle:
    """One engine the gateway may send requests to."""

    name: str
    """Stable name of the engine (its base URL today), for logs and metrics."""
    client: EngineClient
    load: LoadWatcher | None = None
    """The engine's live state (`latest`, `backlog()`; `sent()` on dispatch); None when the
    engine does not report it (stock SGLang)."""


@dataclass(frozen=True)
class Placement:
    """Where one request runs."""

    engine: EngineHandle


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


def choose_engine(request: EngineRequest, candidates: Sequence[EngineHandle]) -> EngineHandle:
    """The engine to run *request* on, among *candidates* (at least one). With one engine the
    choice is forced; a pool will rank the candidates by their live state here."""
    if not candidates:
        raise ValueError("no engine to place the request on")
    return candidates[0]
