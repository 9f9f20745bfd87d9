"""The engine's live state at the gateway, for the SLO admission (gateway/pipeline/admission.py).

`LoadWatcher` keeps one engine's latest `common.wire.EngineLoad` and the RT work the gateway sent
after that state was taken (`backlog`), which the engine's report cannot show yet.

Freshness: `run` long-polls the engine's `CONTROL_LOAD_PATH` with ``after=<the iteration it
has>``; the engine answers as soon as a later iteration has run (it publishes one report per
iteration), so `latest` trails the engine by at most the iteration in flight plus one HTTP round
trip over a local socket. An engine whose reports skip iterations the watcher never saw counts
them in `missed_iterations` (the measured staleness). The patched SGLang engine serves the poll on
its control socket (Unix), the simulator on its HTTP port (it has no control socket): the same
path and semantics, another transport.

Backlog (in total and by tenant, for the per-tenant forecast): an RT request the gateway
dispatched reaches the engine's queue a little later (HTTP, SGLang's tokenizer process), so a
report taken just after the send may not show it yet. Each send is remembered with the
wall-clock instant, the iteration the watcher had seen and its tenant, and is dropped once a
report was taken after the send (`at_unix_s`: the engine's wall clock, on the same host as the
gateway, so the two clocks agree) *and* at least two iterations after the one seen then (the
engine may have been one ahead; the next full iteration started after the send, with the request
queued unless dispatch took longer than an iteration). Until then it is counted twice at worst —
a conservative forecast for an iteration or two, never a blind one. Or once a report shows one
iteration that started after the send and left the engine with nothing to run or queued: an idle
engine runs no second iteration to show it by (`_shows`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import msgspec
from prometheus_client.core import GaugeMetricFamily

from backend.policy.feasibility import NO_BACKLOG, Backlog, idle
from common.config import EngineConfig
from common.wire import CONTROL_LOAD_PATH, EngineLoad, TenantLoad

logger = logging.getLogger(__name__)

POLL_WAIT_S = 1.0
"""How long the engine holds one long poll when no iteration runs (an idle engine)."""
RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0
"""Backoff between attempts while the engine's endpoint does not answer, seconds."""
SENT_KEPT_S = 60.0
"""A sent request no report accounted for within this long is forgotten (a safety bound: an
engine that never reports again must not inflate the backlog forever)."""
_DECODER = msgspec.json.Decoder(EngineLoad)


class _Sent(msgspec.Struct, frozen=True):
    at_unix_s: float
    seen_iteration: int
    prompt_tokens: int
    tenant_id: str
    weight: float


def _shows(load: EngineLoad, sent: _Sent) -> bool:
    """Whether the report *load* accounts for the request *sent* (the module doc): taken after
    the send, two iterations after the one seen then; or one, where that iteration started
    after the send and left the engine with nothing to run — the request ran in it and
    finished (a one-token answer on an idle engine runs one iteration; kept until a second,
    which an idle engine never runs, it made the next requests' forecasts see the engine
    busy for SENT_KEPT_S, and refuse them on a pace no iteration could re-check)."""
    if load.at_unix_s <= sent.at_unix_s:
        return False
    if load.iteration >= sent.seen_iteration + 2:
        return True
    return (
        load.iteration >= sent.seen_iteration + 1
        and load.iteration_s > 0.0
        and load.at_unix_s - load.iteration_s > sent.at_unix_s
        and idle(load)
    )


class LoadWatcher:
    """One engine's live state as the gateway knows it.

    Read `latest` and `backlog()`, call `sent()` when an RT request is dispatched; `run` (started
    by the app's `load_watchers` cleanup context) keeps `latest` fresh."""

    def __init__(
        self,
        engine_name: str,
        *,
        silence_s: float | None = None,
        on_silent: Callable[[], None] | None = None,
    ) -> None:
        """*silence_s*: when set, a long poll the engine leaves unanswered for `POLL_WAIT_S` +
        *silence_s* (an engine answers one within `POLL_WAIT_S` even when idle) counts as the
        engine not answering: *on_silent* is called (the pool takes the engine out of
        placement) and the poll fails like any other. None: only the session's timeout."""
        self.engine_name = engine_name
        self._silence_s = silence_s
        self._on_silent = on_silent
        self.latest: EngineLoad | None = None
        """The newest state the engine reported; None before its first (or when it is down)."""
        self.received_unix_s: float | None = None
        """When `latest` arrived (wall clock)."""
        self.reports = 0
        """Reports received that carried a new iteration."""
        self.missed_iterations = 0
        """Iterations the engine ran that no report showed (it reported a later one first): the
        watcher trailed by that many; 0 while it keeps up."""
        self.outages = 0
        """Times the engine's endpoint stopped answering (or the engine restarted)."""
        self._sent: collections.deque[_Sent] = collections.deque()
        self._next_report: asyncio.Future[None] | None = None
        """Resolved by the next report of a new iteration (or the engine's loss): what
        `next_report` waits on; None while no one waits."""

    async def next_report(self, timeout_s: float) -> None:
        """Returns when the engine reports its next iteration (or is lost), or after *timeout_s*
        seconds, whichever comes first: the SLO admission re-judges a request it would refuse
        for a transient state on the state that follows it (gateway/pipeline/admission.py)."""
        if timeout_s <= 0.0:
            return
        waiting = self._next_report
        if waiting is None or waiting.done():
            waiting = self._next_report = asyncio.get_running_loop().create_future()
        # asyncio.wait leaves the shared future alone on a timeout (other requests wait on it)
        await asyncio.wait((waiting,), timeout=timeout_s)

    def _wake(self) -> None:
        waiting, self._next_report = self._next_report, None
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    def sent(
        self,
        prompt_tokens: int,
        now_unix_s: float | None = None,
        tenant_id: str = "",
        weight: float = 1.0,
    ) -> None:
        """An RT request with *prompt_tokens* of tenant *tenant_id* (fair-share *weight*) was
        just sent to the engine."""
        seen = self.latest.iteration if self.latest is not None else -1
        now = time.time() if now_unix_s is None else now_unix_s
        self._sent.append(_Sent(now, seen, prompt_tokens, tenant_id, weight))

    def backlog(self, now_unix_s: float | None = None) -> Backlog:
        """RT requests sent that `latest` cannot show yet (all of them before the first report;
        see the module doc for when one counts as shown), in total and by tenant; *now_unix_s*:
        the caller's clock."""
        self._trim(time.time() if now_unix_s is None else now_unix_s)
        if not self._sent:
            return NO_BACKLOG
        # tenant → [weight, requests, prompt tokens]; a handful of sends (an iteration's worth)
        by_tenant: dict[str, list[Any]] = {}
        total = 0
        for s in self._sent:
            total += s.prompt_tokens
            entry = by_tenant.get(s.tenant_id)
            if entry is None:
                by_tenant[s.tenant_id] = [s.weight, 1, s.prompt_tokens]
            else:
                entry[1] += 1
                entry[2] += s.prompt_tokens
        return Backlog(
            len(self._sent),
            total,
            tuple(
                TenantLoad(
                    tenant_id=tenant_id,
                    weight=weight,
                    num_waiting=count,
                    waiting_prompt_tokens=tokens,
                )
                for tenant_id, (weight, count, tokens) in by_tenant.items()
            ),
        )

    def update(self, load: EngineLoad) -> None:
        """Takes a report from the engine (older or repeated ones change nothing; an iteration
        counter that went back means the engine restarted: the backlog is forgotten with it)."""
        prev = self.latest
        if prev is not None and load.iteration < prev.iteration:
            logger.info("engine %s restarted (iteration %d)", self.engine_name, load.iteration)
            self.outages += 1
            self._sent.clear()
        elif prev is not None and load.iteration == prev.iteration:
            self.latest = load  # the same iteration (an idle poll's answer): nothing new
            return
        elif prev is not None:
            self.missed_iterations += load.iteration - prev.iteration - 1
        self.latest = load
        self.received_unix_s = time.time()
        self.reports += 1
        self._trim(self.received_unix_s)
        self._wake()

    def lost(self) -> None:
        """The engine's endpoint does not answer: nothing is known about it (its in-flight
        requests fail with it)."""
        self.latest = None
        self.received_unix_s = None
        self._sent.clear()
        self._wake()

    def _trim(self, now_unix_s: float) -> None:
        latest = self.latest
        sent = self._sent
        while sent and (
            sent[0].at_unix_s < now_unix_s - SENT_KEPT_S
            or (latest is not None and _shows(latest, sent[0]))
        ):
            sent.popleft()

    async def run(self, session: aiohttp.ClientSession, url: str) -> None:
        """Long-polls *url* (the engine's `CONTROL_LOAD_PATH`) until cancelled; logs once per
        outage and retries with backoff."""
        backoff_s = RETRY_MIN_S
        down = False
        while True:
            after = self.latest.iteration if self.latest is not None else -1
            bound_s = None if self._silence_s is None else POLL_WAIT_S + self._silence_s
            try:
                async with (
                    asyncio.timeout(bound_s),
                    session.get(
                        url, params={"after": str(after), "wait_s": str(POLL_WAIT_S)}
                    ) as resp,
                ):
                    resp.raise_for_status()
                    load = _DECODER.decode(await resp.read())
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, TimeoutError, msgspec.DecodeError) as exc:
                silent = isinstance(exc, TimeoutError) and bound_s is not None
                if silent and self._on_silent is not None:
                    self._on_silent()  # the engine no longer answers at all
                if not down:
                    logger.warning(
                        "engine %s load reports unavailable (%s); retrying",
                        self.engine_name,
                        str(exc) or exc.__class__.__name__,  # a timeout has no message
                    )
                    down = True
                    self.outages += 1
                self.lost()
                await asyncio.sleep(backoff_s)
                backoff_s = min(RETRY_MAX_S, backoff_s * 2)
                continue
            if down:
                logger.info("engine %s load reports back", self.engine_name)
                down = False
            backoff_s = RETRY_MIN_S
            self.update(load)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """`/metrics`: the newest report's iteration, requests and age; the iterations the
        watcher missed."""
        labels = [self.engine_name]
        latest = self.latest
        if latest is not None:
            iteration = GaugeMetricFamily(
                "tandem_engine_load_iteration",
                "Iterations the engine had run at its newest live-state report at the gateway.",
                labels=["engine"],
            )
            iteration.add_metric(labels, float(latest.iteration))
            yield iteration
            live = GaugeMetricFamily(
                "tandem_engine_load_requests",
                "Requests on the engine at its newest live-state report (the SLO admission's "
                "view), by tier and state (waiting: first token still to come).",
                labels=["engine", "tier", "state"],
            )
            live.add_metric([*labels, "rt", "waiting"], float(latest.num_rt_waiting))
            live.add_metric([*labels, "rt", "running"], float(latest.num_rt_running))
            live.add_metric([*labels, "be", "waiting"], float(latest.num_be_waiting))
            live.add_metric([*labels, "be", "running"], float(latest.num_be_running))
            yield live
            age = GaugeMetricFamily(
                "tandem_engine_load_age_seconds",
                "Age of the engine's newest live-state report at the gateway (the SLO "
                "admission's view): since the engine took it (grows while the engine is idle: "
                "it reports after iterations only).",
                labels=["engine"],
            )
            age.add_metric(labels, max(0.0, time.time() - latest.at_unix_s))
            yield age
        missed = GaugeMetricFamily(
            "tandem_engine_load_missed_iterations",
            "Engine iterations no live-state report showed the gateway since it started (it "
            "trailed by more than one iteration; only grows).",
            labels=["engine"],
        )
        missed.add_metric(labels, float(self.missed_iterations))
        yield missed


def load_endpoint(engine: EngineConfig) -> tuple[aiohttp.BaseConnector, str]:
    """Where an engine serves its load reports: the patched engine's control socket, or the
    simulator's HTTP port (no control socket there); a new connector and the URL."""
    if engine.kind == "sim":
        return aiohttp.TCPConnector(), f"http://{engine.host}:{engine.port}{CONTROL_LOAD_PATH}"
    return aiohttp.UnixConnector(
        path=engine.control_socket_path
    ), f"http://engine{CONTROL_LOAD_PATH}"


def serves_load(engine: EngineConfig) -> bool:
    """Whether the engine reports its load: the simulator always, SGLang with tandem's policy
    in charge (the control endpoint runs with the driver)."""
    return engine.kind == "sim" or engine.policy_in_charge


async def watch(watcher: LoadWatcher, engine: EngineConfig) -> AsyncIterator[None]:
    """Runs *watcher* against *engine* while the generator is suspended; stops it on close
    (wrap in `contextlib.asynccontextmanager`, or use as an aiohttp cleanup context body)."""
    connector, url = load_endpoint(engine)
    timeout = aiohttp.ClientTimeout(total=POLL_WAIT_S + 10.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        task = asyncio.create_task(watcher.run(session, url), name="tandem-load-watch")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
