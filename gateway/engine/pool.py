"""The engines behind the gateway: one `EngineReplica` per engine of the pool (`engine.replicas`
launched on this host, or the `engine.endpoints` started elsewhere, or the one engine at
`engine.host:port`), each with its own HTTP client, health, live-state watcher and statistics.

Placement (gateway/pipeline/placement.py) offers a request the replicas that serve
(`EnginePool.serving`); `/readyz` is 200 while at least one does; `/metrics` and the dashboard
show each one.

When a replica counts as serving, and how fast it stops:

* its health (`gateway.engine.health.EngineHealth`) says up: fed by its supervisor when
  `tandem serve` launched it (a process that exits is seen the moment it does, through its
  pidfd), else by the gateway's own `GET /health` probe every `engine.health_probe_interval_s`;
* and nothing found it gone since its last good probe: a request whose engine was unreachable
  or went away with it (a SIGKILLed replica's streams break at once), or its live-state watcher
  whose long poll went unanswered for `SILENCE_S` beyond its wait (a hung or frozen engine),
  `suspect`s its replica, which is out of placement from that instant until a probe of the
  gateway's own, repeated every `SUSPECT_PROBE_INTERVAL_S`, finds it answering again. In a pool
  of one there is nowhere else to go, so a suspicion only hurries the next probe, as before the
  pool (and the watcher keeps its usual timeout).

A request in flight on a replica that dies ends with the engine's failure (a streamed error
event, a 503, a batch line put back for a retry), never waiting for the health view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from common.config import LOCAL_HOSTS, EngineConfig, pool_engines
from common.sockets import socket_is_live
from gateway.engine.health import FIRST_PROBE_TIMEOUT_S, EngineHealth
from gateway.engine.load import serves_load

if TYPE_CHECKING:
    from gateway.engine.client import EngineClient
    from gateway.engine.stats import EngineStatsWindow

log = logging.getLogger(__name__)

SUSPECT_PROBE_INTERVAL_S = 0.5
"""How often a suspected replica is probed until it answers again, seconds."""
SILENCE_S = 0.8
"""In a pool, a replica whose live-state long poll (answered within a second even by an idle
engine, `gateway.engine.load.POLL_WAIT_S`) stays unanswered this much longer, seconds, is
suspect: a hung or frozen engine leaves placement within 1.8 s of its last answer. A false
alarm (an engine slow to answer under load) costs little: the next probe that answers puts it
back."""


def engine_url(engine: EngineConfig) -> str:
    """The base URL of the engine *engine* describes (its name in logs, metrics and placement:
    `EngineHandle.name`, `EngineClient.base_url`)."""
    return f"http://{engine.host}:{engine.port}"


class EngineReplica:
    """One engine of the pool, as the gateway knows it — or one data-parallel rank of an engine
    that runs SGLang's data parallelism (`dp_rank`): each rank schedules its own requests and
    reports its own live state, so the gateway places on it as on an engine of its own, and
    SGLang routes a request sent to it to that rank (`routed_dp_rank`)."""

    def __init__(
        self,
        index: int,
        engine: EngineConfig,
        *,
        attached: bool,
        dp_rank: int | None = None,
        health: EngineHealth | None = None,
    ) -> None:
        """*index*: the engine's place in the pool (its supervisor's, shared by its ranks);
        *health*: its engine's, shared by the ranks of one engine (one process group)."""
        self.index = index
        self.dp_rank = dp_rank
        """The engine's data-parallel rank this replica is; None: the engine has one."""
        if dp_rank is not None:
            rank_socket = engine.control_socket_of_rank(dp_rank)
            engine = msgspec.structs.replace(engine, control_socket=rank_socket)
        self.engine = engine
        """This engine's own config (its host, port, and the control socket of this rank)."""
        self.url = engine_url(engine)
        """The engine's base URL (its ranks share it)."""
        self.attached = attached
        """Started elsewhere (`engine.endpoints`), not by this `tandem serve`."""
        self.name = self.url if dp_rank is None else f"{self.url}#dp{dp_rank}"
        """Its name in logs, metrics, placement and the live-state watchers: the engine's base
        URL, with "#dp<k>" for data-parallel rank k."""
        self.health = EngineHealth(self.url) if health is None else health
        self.supervised = False
        """Its health is fed by its supervisor (`take_supervision`), not the gateway's probe."""
        self.suspected = False
        """A request found it gone since its last good probe (see the module docstring)."""
        self.client: EngineClient | None = None
        """Set when the app starts (`gateway.app`)."""
        self.stats: EngineStatsWindow | None = None
        """Its control endpoint's statistics, when the gateway reads them."""
        self._suspect_task: asyncio.Task[None] | None = None

    @property
    def is_serving(self) -> bool:
        """Whether requests may be placed on it now."""
        return self.health.is_up and not self.suspected

    @property
    def state(self) -> str:
        """A word for operators: its health's state, or "suspect"."""
        return "suspect" if self.suspected and self.health.is_up else self.health.state

    @property
    def control_socket(self) -> str | None:
        """The Unix socket of its control endpoint (live state, statistics, length histories);
        None where the gateway cannot reach one: stock SGLang, tandem's policy not in charge,
        the simulator (it serves its live state over HTTP), or an engine on another host, or an
        attached local one whose socket does not exist."""
        engine = self.engine
        if engine.kind != "sglang" or not engine.policy_in_charge:
            return None
        reachable = engine.host in LOCAL_HOSTS and os.path.exists(engine.control_socket_path)
        if self.attached and not reachable:
            return None
        return engine.control_socket_path

    @property
    def reports_load(self) -> bool:
        """Whether the gateway can watch its live state (`gateway.engine.load`)."""
        return serves_load(self.engine) and (
            self.engine.kind == "sim" or self.control_socket is not None
        )

    def take_supervision(self) -> EngineHealth:
        """Its supervisor feeds its health from now on (`tandem serve` calls this before the
        app starts, for an engine it launched and is ready); the health to feed."""
        self.supervised = True
        self.health.update(is_up=True, state="up", detail="launched and ready")
        return self.health

    def require_client(self) -> EngineClient:
        """Its HTTP client (the app has started)."""
        assert self.client is not None, "the pool's clients are set when the app starts"
        return self.client


class EnginePool:
    """The engines of the gateway (see the module docstring)."""

    def __init__(self, engine: EngineConfig) -> None:
        attached = bool(engine.endpoints)
        self.replicas: list[EngineReplica] = []
        for i, e in enumerate(pool_engines(engine)):
            ranks = dp_ranks_of(e, attached=attached)
            if ranks == 1:
                self.replicas.append(EngineReplica(i, e, attached=attached))
                continue
            health = EngineHealth(engine_url(e))
            self.replicas.extend(
                EngineReplica(i, e, attached=attached, dp_rank=k, health=health)
                for k in range(ranks)
            )
        self._config = engine

    def __len__(self) -> int:
        return len(self.replicas)

    def of_engine(self, index: int) -> list[EngineReplica]:
        """The replicas of engine *index* of the pool: the engine, or each of its
        data-parallel ranks."""
        return [r for r in self.replicas if r.index == index]

    def by_name(self, name: str) -> EngineReplica | None:
        """The replica named *name* (`EngineReplica.name`), if any."""
        for replica in self.replicas:
            if replica.name == name:
                return replica
        return None

    def serving(self) -> list[EngineReplica]:
        """The replicas requests may be placed on now."""
        return [r for r in self.replicas if r.is_serving]

    @property
    def is_serving(self) -> bool:
        """At least one replica serves (what `/readyz` answers)."""
        return any(r.is_serving for r in self.replicas)

    def suspect(self, name: str, why: str = "a request lost it") -> None:
        """A request found replica *name* unreachable or lost it, or its live state went
        silent (*why*): out of placement until a probe finds it answering (in a pool of one:
        its next probe comes now)."""
        replica = self.by_name(name)
        if replica is None:
            return
        replica.health.suspect()  # the gateway's own interval probe, if it runs, looks now
        if len(self.replicas) == 1 or replica.client is None:
            return
        if not replica.suspected:
            log.warning("engine %s: %s; out of placement until it answers", name, why)
        replica.suspected = True
        if replica._suspect_task is None or replica._suspect_task.done():
            replica._suspect_task = asyncio.create_task(self._clear_when_answering(replica))

    async def _clear_when_answering(self, replica: EngineReplica) -> None:
        client = replica.require_client()
        timeout_s = min(self._config.health_probe_timeout_s, FIRST_PROBE_TIMEOUT_S)
        while replica.suspected:
            if await client.is_healthy(timeout_s):
                replica.suspected = False
                log.info("engine %s answers again: back in placement", replica.name)
                return
            await asyncio.sleep(SUSPECT_PROBE_INTERVAL_S)

    async def first_probe(self) -> None:
        """Probes every replica the gateway watches itself, once, before serving (at most
        `FIRST_PROBE_TIMEOUT_S`: a hung engine must not hold the gateway's start-up)."""
        timeout_s = min(self._config.health_probe_timeout_s, FIRST_PROBE_TIMEOUT_S)
        probes = [
            r.health.probe(r.require_client().is_healthy, timeout_s)
            for r in self.replicas
            if not r.supervised
        ]
        if probes:
            await asyncio.gather(*probes)

    def start_watching(self) -> list[asyncio.Task[None]]:
        """The gateway's own probes of the replicas no supervisor feeds, until cancelled."""
        cfg = self._config
        return [
            asyncio.create_task(
                r.health.watch(
                    r.require_client().is_healthy,
                    cfg.health_probe_interval_s,
                    cfg.health_probe_timeout_s,
                ),
                name=f"tandem-health-{r.index}",
            )
            for r in self.replicas
            if not r.supervised
        ]

    async def close(self) -> None:
        """Stops the suspicion probes."""
        tasks = [r._suspect_task for r in self.replicas if r._suspect_task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def describe_attachments(self) -> list[str]:
        """One line per attached engine (`engine.endpoints`): whether the gateway sees its live
        state through tandem's control endpoint, or uses it with tandem's request metadata
        only. Empty for launched engines."""
        lines = []
        for r in self.replicas:
            if not r.attached:
                continue
            if r.reports_load:
                lines.append(f"engine {r.name}: tandem's plugin, live state watched")
            else:
                lines.append(
                    f"engine {r.name}: no tandem control endpoint reachable from this host "
                    "(stock SGLang, or another host): used with tandem's request metadata only "
                    "(no live state for the SLO admission and the batch pause, no length "
                    "histories pushed)"
                )
        return lines

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        """`/metrics`: each replica's health, state and restarts (label `engine`)."""
        up = GaugeMetricFamily(
            "tandem_engine_healthy",
            "1 while the engine serves (answers its health probe and no request found it "
            "gone since), 0 while it is down, restarting, unresponsive or suspect (placement "
            "and /readyz answer from it).",
            labels=["engine"],
        )
        state = GaugeMetricFamily(
            "tandem_engine_state",
            "1 for the engine's current state (up, suspect, unreachable, unresponsive, down, "
            "restarting, stopped, unknown).",
            labels=["engine", "state"],
        )
        restarts = CounterMetricFamily(
            "tandem_engine_restarts",
            "Times the engine this gateway supervises died and was restarted.",
            labels=["engine"],
        )
        for r in self.replicas:
            up.add_metric([r.name], 1.0 if r.is_serving else 0.0)
            state.add_metric([r.name, r.state], 1.0)
            restarts.add_metric([r.name], float(r.health.restarts))
        yield up
        yield state
        yield restarts


def dp_ranks_of(engine: EngineConfig, *, attached: bool) -> int:
    """How many data-parallel ranks of *engine* the gateway places on, ranks: a launched patched
    SGLang engine's `dp_size` (from `engine.extra_args`); one started elsewhere on this host, its
    rank 0 and each further rank whose control socket answers (an engine on another host, or
    without tandem's policy, is one replica: SGLang's own DP controller spreads its requests)."""
    if engine.kind != "sglang" or not engine.policy_in_charge:
        return 1
    if not attached and engine.launch:
        return engine.dp_size
    if engine.host not in LOCAL_HOSTS:
        return 1
    ranks = 1
    while socket_is_live(engine.control_socket_of_rank(ranks)):
        ranks += 1
    return ranks


def merged_by_engine(
    sources: Iterable[tuple[str, Callable[[], Iterator[GaugeMetricFamily]]]],
) -> Iterator[GaugeMetricFamily]:
    """The metric families of several engines' collectors as one family per name, each sample
    labelled with its engine (`engine`, added where a collector's family lacks it): a scrape
    must not carry a family twice."""
    families: dict[str, GaugeMetricFamily] = {}
    for engine, collect in sources:
        for family in collect():
            merged = families.get(family.name)
            if merged is None:
                merged = GaugeMetricFamily(family.name, family.documentation, labels=[])
                families[family.name] = merged
            for sample in family.samples:
                labels = dict(sample.labels)
                labels.setdefault("engine", engine)
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    yield from families.values()
