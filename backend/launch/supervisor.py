"""Keeping one engine process serving: notice its death, reap it, restart it with a back-off.

    supervisor = EngineSupervisor(engine, RestartPolicy.of(cfg.engine), on_status=show)
    task = asyncio.create_task(supervisor.run())   # the engine is started and ready already
    ...
    task.cancel()                                   # then engine.stop() as usual

An engine dies in one of two ways, and both are noticed while it happens:

* its main process exits (a crash, the OOM killer, a SIGKILL): the event loop is woken by the
  process's pidfd the moment it exits, and the process is reaped at once (no zombie);
* one of its scheduler processes dies while the main process runs on (the OOM killer's likely
  pick: the scheduler holds the model and the KV pool; or one DP rank's crash): SGLang does not
  notice, and every request that reaches that scheduler hangs. Each scheduler serves tandem's
  control socket (`scheduler_sockets`), checked every `SCHEDULER_CHECK_INTERVAL_S`: one that
  refuses connections (its server is gone) makes the engine count as dead at once. It is then
  SIGKILLed, group and all, like a hung one;
* it stops answering: ``GET /health`` fails ``probe_failures`` times in a row while the process
  still runs (a hung scheduler). It is then SIGKILLed, group and all.

Either way it is restarted after a back-off that doubles with every death in a row (an engine
that served ``stable_s`` since its last restart starts over at ``backoff_s``), capped at
``backoff_max_s``: an input that kills the engine on every restart costs one restart per cap
at worst, never a tight loop. Each death and each restart is one log line naming the exit
status. Whoever needs to know (the gateway's ``/readyz`` and ``/metrics``) is told of every
change through ``on_status``: the supervisor imports nothing above the launch layer.

One supervisor watches one `EngineProcess`; a pool of engines is a supervisor per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from backend.launch.sglang import EngineProcess, EngineStartError, health_status
from common.config import EngineConfig
from common.sockets import socket_server_gone

log = logging.getLogger(__name__)

SCHEDULER_CHECK_INTERVAL_S = 0.5
"""How often the supervisor checks that each scheduler's control socket still has its server,
seconds (a connect on a Unix socket: microseconds)."""

EXIT_GRACE_S = 2.0
"""How long the supervisor waits, seconds, for the main process to exit once a scheduler's
socket is gone or the health probe gave up, before it kills the engine itself. A main process
that was killed takes its scheduler down with it, and on a busy machine the scheduler's socket
can close before the main process's exit is seen: the report then names the real cause (its
exit) rather than the symptom."""

EnginePhase = Literal["up", "unresponsive", "down", "restarting", "stopped"]
"""Where a supervised engine is: "up" (answers its health probe), "unresponsive" (running, but
its last health probe failed), "down" (dead, waiting out the back-off), "restarting" (a new
process started, not healthy yet), "stopped" (no longer supervised)."""

Probe = Callable[[str, float], Awaitable[int | None]]
"""``probe(base_url, timeout_s)``: the HTTP status of ``GET /health``, None when nothing answered
in time."""


@dataclass(frozen=True)
class EngineStatus:
    """What a supervisor knows of its engine, as of its last change."""

    phase: EnginePhase
    restarts: int
    """Restarts that brought the engine back so far."""
    detail: str
    """One line for an operator: why it is not up, or how it came back."""
    pid: int | None
    """The engine's main process id (None while none runs)."""

    @property
    def is_serving(self) -> bool:
        """Whether requests may be sent to the engine."""
        return self.phase == "up"


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised engine counts as dead, and how soon it is restarted (the `engine.*`
    fields of the same names say more)."""

    backoff_s: float = 1.0
    """Wait before the first restart in a row, seconds."""
    backoff_max_s: float = 60.0
    """Longest wait before a restart, seconds."""
    stable_s: float = 120.0
    """Up this long, seconds, an engine that dies starts the back-off over."""
    startup_timeout_s: float = 300.0
    """How long a restarted engine may take to answer its health probe, seconds."""
    probe_interval_s: float = 5.0
    """Time between health probes of a running engine, seconds."""
    probe_timeout_s: float = 30.0
    """How long one health probe may take, seconds."""
    probe_failures: int = 3
    """Failed probes in a row that make a running engine count as hung."""

    @classmethod
    def of(cls, engine: EngineConfig) -> RestartPolicy:
        """The policy `engine.*` configures."""
        return cls(
            backoff_s=engine.restart_backoff_s,
            backoff_max_s=engine.restart_backoff_max_s,
            stable_s=engine.restart_stable_s,
            startup_timeout_s=engine.startup_timeout_s,
            probe_interval_s=engine.health_probe_interval_s,
            probe_timeout_s=engine.health_probe_timeout_s,
            probe_failures=engine.health_probe_failures,
        )

    def delay_s(self, deaths_in_a_row: int) -> float:
        """The wait before restarting an engine that died *deaths_in_a_row* times (≥ 1) without
        serving `stable_s` in between, seconds: `backoff_s`, doubled per death, capped."""
        doublings = min(max(deaths_in_a_row - 1, 0), 62)
        return min(self.backoff_s * 2.0**doublings, self.backoff_max_s)


def describe_exit(returncode: int | None) -> str:
    """An exit status in words: "killed by SIGKILL (status -9)", "exit status 1"."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (status {returncode})"
    return f"exit status {returncode}"


class EngineSupervisor:
    """Watches one engine process and restarts it whenever it dies (see the module docstring).

    `run` supervises until it is cancelled; it never stops the engine itself on the way out
    (whoever started the engine stops it), and never raises for an engine failure."""

    def __init__(
        self,
        engine: EngineProcess,
        policy: RestartPolicy,
        *,
        on_status: Callable[[EngineStatus], None] | None = None,
        probe: Probe | None = None,
        clock: Callable[[], float] = time.monotonic,
        scheduler_sockets: Sequence[str] = (),
    ) -> None:
        """*on_status* is called with every new `EngineStatus` (on the event loop; it must not
        block). *probe* replaces ``GET /health`` (tests); *clock* the monotonic clock.
        *scheduler_sockets*: the control socket each of the engine's schedulers serves (one per
        DP rank; none without tandem's policy in charge)."""
        self.engine = engine
        self.policy = policy
        self.scheduler_sockets = list(scheduler_sockets)
        self._on_status = on_status
        self._probe: Probe = probe or health_status
        self._clock = clock
        self._restarts = 0
        self._status = EngineStatus(phase="up", restarts=0, detail="", pid=engine.pid)

    @property
    def status(self) -> EngineStatus:
        """The engine's status as of its last change."""
        return self._status

    @property
    def name(self) -> str:
        """The engine's name in logs: its base URL."""
        return self.engine.base_url

    async def run(self) -> None:
        """Supervises the engine until cancelled. An engine that is not running when this
        starts is taken for one that just died."""
        deaths_in_a_row = 0
        try:
            if self.engine.is_running:
                self._set("up", "serving")
                up_since = self._clock()
                reason = await self._watch()
            else:
                up_since = self._clock()
                reason = f"not running ({describe_exit(self.engine.returncode)})"
            while True:
                if self._clock() - up_since >= self.policy.stable_s:
                    deaths_in_a_row = 0
                deaths_in_a_row += 1
                deaths_in_a_row = await self._restart(reason, deaths_in_a_row)
                up_since = self._clock()
                reason = await self._watch()
        finally:
            self._set("stopped", "no longer supervised")

    async def _restart(self, reason: str, deaths_in_a_row: int) -> int:
        """Restarts the engine that died of *reason* until one comes up; the deaths in a row
        it took (failed starts count)."""
        while True:
            delay_s = self.policy.delay_s(deaths_in_a_row)
            self._set(
                "down",
                f"{reason}; restart {self._restarts + 1} in {delay_s:.3g} s",
                level=logging.ERROR,
            )
            await asyncio.sleep(delay_s)
            started = self._clock()
            try:
                self.engine.start()
                self._set(
                    "restarting", f"restart {self._restarts + 1}: pid {self.engine.pid} starting"
                )
                await self.engine.wait_ready(self.policy.startup_timeout_s)
            except (EngineStartError, OSError) as exc:
                self.engine.kill()  # one that timed out is still running: it goes too
                reason = f"restart failed: {(str(exc).splitlines() or [repr(exc)])[0]}"
                deaths_in_a_row += 1
                continue
            self._restarts += 1
            took_s = self._clock() - started
            self._set("up", f"restart {self._restarts}: serving again after {took_s:.1f} s")
            return deaths_in_a_row

    async def _watch(self) -> str:
        """Waits until the running engine dies; why (its exit status). A hung one is killed
        here; an exited one is reaped."""
        exited = asyncio.create_task(self.engine.wait_exit())
        hung = asyncio.create_task(self._probe_until_hung())
        broken = asyncio.create_task(self._until_a_scheduler_is_gone())
        try:
            await asyncio.wait({exited, hung, broken}, return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():
                await asyncio.wait({exited}, timeout=EXIT_GRACE_S)
        finally:
            for task in (exited, hung, broken):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        pid = self.engine.pid
        if exited.done() and not exited.cancelled():
            exit_status = exited.result()
            self.engine.stop()  # the rest of its group, if any outlived it
            return f"engine pid {pid} exited: {describe_exit(exit_status)}"
        why = broken.result() if broken.done() and not broken.cancelled() else hung.result()
        return f"engine pid {pid} {why}; killed: {describe_exit(self.engine.kill())}"

    async def _until_a_scheduler_is_gone(self) -> str:
        """Checks every `SCHEDULER_CHECK_INTERVAL_S` that each scheduler's control socket still
        has its server; returns (why) when one has not. Waits for ever without sockets."""
        if not self.scheduler_sockets:
            await asyncio.Event().wait()
        while True:
            await asyncio.sleep(SCHEDULER_CHECK_INTERVAL_S)
            for rank, path in enumerate(self.scheduler_sockets):
                if socket_server_gone(path):
                    which = (
                        "its scheduler"
                        if len(self.scheduler_sockets) == 1
                        else (f"the scheduler of its DP rank {rank}")
                    )
                    return f"lost {which} (control socket {path} refuses connections)"

    async def _probe_until_hung(self) -> str:
        """Probes the running engine every `probe_interval_s`; returns (why) once
        `probe_failures` probes in a row have failed. Any failed probe makes it unresponsive
        until one succeeds."""
        failures = 0
        while True:
            await asyncio.sleep(self.policy.probe_interval_s)
            status = await self._probe(self.engine.base_url, self.policy.probe_timeout_s)
            if status == 200:
                if failures:
                    self._set("up", "answers its health probe again")
                failures = 0
                continue
            failures += 1
            what = (
                f"no answer within {self.policy.probe_timeout_s:g} s"
                if status is None
                else f"answered {status}"
            )
            if failures >= self.policy.probe_failures:
                return f"failed {failures} health probes in a row (last: {what})"
            self._set(
                "unresponsive",
                f"health probe failed ({what}); {failures} of {self.policy.probe_failures} "
                "before a restart",
                level=logging.WARNING,
            )

    def _set(self, phase: EnginePhase, detail: str, *, level: int = logging.INFO) -> None:
        self._status = EngineStatus(
            phase=phase, restarts=self._restarts, detail=detail, pid=self.engine.pid
        )
        log.log(level, "engine %s %s: %s", self.name, phase, detail)
        if self._on_status is not None:
            self._on_status(self._status)
