"""The engine supervisor's decisions, on a fake engine process (no process, no HTTP): when it
takes the engine for dead, how long it waits before each restart, and what it reports.
tests/functional/test_engine_supervisor.py runs it on real processes."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from backend.launch import supervisor as supervisor_module
from backend.launch.sglang import EngineProcess, EngineStartError
from backend.launch.supervisor import (
    EngineStatus,
    EngineSupervisor,
    RestartPolicy,
    describe_exit,
)
from common.sockets import socket_server_gone
from tests.waiting import wait_until


@dataclass
class FakeEngine:
    """Just what the supervisor uses of an `EngineProcess`. Each start is one incarnation; the
    test kills the running one with `die`, and `fail_starts` starts fail before serving."""

    base_url: str = "http://engine.test"
    fail_starts: int = 0
    starts: int = 0
    pid: int | None = 100
    _exit: asyncio.Future[int] | None = None
    killed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._exit = asyncio.get_running_loop().create_future()

    @property
    def is_running(self) -> bool:
        return self._exit is not None and not self._exit.done()

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit is not None and self._exit.done() else None

    def die(self, returncode: int = -9) -> None:
        assert self._exit is not None
        self._exit.set_result(returncode)

    def start(self) -> None:
        assert not self.is_running
        self.starts += 1
        self.pid = 100 + self.starts
        self._exit = asyncio.get_running_loop().create_future()

    async def wait_ready(self, timeout_s: float) -> None:
        if self.fail_starts:
            self.fail_starts -= 1
            self.die(3)
            raise EngineStartError("engine exited with code 3\n--- log tail ---\nno model")

    async def wait_exit(self) -> int:
        assert self._exit is not None
        return await asyncio.shield(self._exit)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        return self.returncode

    def kill(self) -> int | None:
        if self.is_running:
            self.killed.append(self.pid or 0)
            self.die(-9)
        return self.returncode


FAST = RestartPolicy(
    backoff_s=0.01,
    backoff_max_s=0.04,
    stable_s=60.0,
    startup_timeout_s=5.0,
    probe_interval_s=0.01,
    probe_timeout_s=1.0,
    probe_failures=3,
)


def supervise(
    engine: FakeEngine, policy: RestartPolicy = FAST, answers: list[int | None] | None = None
) -> tuple[EngineSupervisor, list[EngineStatus]]:
    """A supervisor of *engine* whose health probes answer *answers* in turn (then 200)."""
    seen: list[EngineStatus] = []
    pending = list(answers or [])

    async def probe(url: str, timeout_s: float) -> int | None:
        return pending.pop(0) if pending else 200

    supervisor = EngineSupervisor(
        cast(EngineProcess, engine), policy, on_status=seen.append, probe=probe
    )
    return supervisor, seen


def test_the_backoff_doubles_from_its_start_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=60.0)
    assert [policy.delay_s(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert policy.delay_s(10_000) == 60.0  # no overflow however long it keeps dying


def test_exit_statuses_are_named() -> None:
    assert describe_exit(-9) == "killed by SIGKILL (status -9)"
    assert describe_exit(1) == "exit status 1"
    assert describe_exit(None) == "exit status unknown"


async def test_an_engine_that_exits_is_restarted_and_reported() -> None:
    engine = FakeEngine()
    supervisor, seen = supervise(engine)
    task = asyncio.create_task(supervisor.run())
    try:
        await wait_until(lambda: seen and seen[-1].phase == "up", 5, what="supervising")
        engine.die(-9)
        await wait_until(lambda: supervisor.status.restarts == 1, 5, what="a restart")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    phases = [s.phase for s in seen]
    assert phases == ["up", "down", "restarting", "up", "stopped"]
    assert "exited: killed by SIGKILL (status -9)" in seen[1].detail
    assert seen[3].is_serving and seen[3].pid == 101 and seen[3].restarts == 1
    assert engine.starts == 1


async def test_failed_restarts_back_off_doubling_to_the_cap() -> None:
    engine = FakeEngine(fail_starts=3)
    supervisor, seen = supervise(engine)
    task = asyncio.create_task(supervisor.run())
    try:
        await wait_until(lambda: seen and seen[-1].phase == "up", 5, what="supervising")
        engine.die(1)
        await wait_until(lambda: supervisor.status.restarts == 1, 5, what="a restart")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert restart_waits_s(seen) == [0.01, 0.02, 0.04, 0.04]
    downs = [s.detail for s in seen if s.phase == "down"]
    assert "exit status 1" in downs[0]
    assert all("restart failed: engine exited with code 3" in d for d in downs[1:])
    assert engine.starts == 4 and seen[-2].is_serving and seen[-1].phase == "stopped"


async def test_an_engine_that_stops_answering_is_killed_and_restarted() -> None:
    engine = FakeEngine()
    supervisor, seen = supervise(engine, answers=[None, 503, None])
    task = asyncio.create_task(supervisor.run())
    try:
        await wait_until(lambda: supervisor.status.restarts == 1, 5, what="a restart")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    phases = [s.phase for s in seen]
    assert phases == ["up", "unresponsive", "unresponsive", "down", "restarting", "up", "stopped"]
    assert not seen[1].is_serving  # /readyz says 503 from the first failed probe
    assert "failed 3 health probes in a row" in seen[3].detail
    assert engine.killed == [100]


async def test_one_failed_probe_is_not_a_death() -> None:
    engine = FakeEngine()
    supervisor, seen = supervise(engine, answers=[None, 200, None, 200])
    task = asyncio.create_task(supervisor.run())
    try:
        await wait_until(lambda: len(seen) >= 5, 5, what="two probe failures and recoveries")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [s.phase for s in seen][:5] == ["up", "unresponsive", "up", "unresponsive", "up"]
    assert engine.starts == 0 and engine.killed == []


@pytest.mark.parametrize("stable", [True, False])
async def test_the_backoff_starts_over_after_a_stable_run(stable: bool) -> None:
    now = [0.0]
    engine = FakeEngine()
    seen: list[EngineStatus] = []
    policy = RestartPolicy(backoff_s=0.01, backoff_max_s=10.0, stable_s=100.0)

    async def healthy(url: str, timeout_s: float) -> int:
        return 200

    supervisor = EngineSupervisor(
        cast(EngineProcess, engine),
        policy,
        on_status=seen.append,
        probe=healthy,
        clock=lambda: now[0],
    )
    task = asyncio.create_task(supervisor.run())
    try:
        for restarts in (1, 2):
            await wait_until(lambda: seen and seen[-1].phase == "up", 5, what="serving")
            now[0] += 150.0 if stable else 1.0  # how long it served before it died
            engine.die(-6)
            await wait_until(
                lambda n=restarts: supervisor.status.restarts >= n, 5, what="a restart"
            )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert restart_waits_s(seen) == [0.01, 0.01 if stable else 0.02]


def restart_waits_s(seen: list[EngineStatus]) -> list[float]:
    """The waits before each restart, as the supervisor announced them."""
    downs = [s.detail for s in seen if s.phase == "down"]
    return [float(d.rsplit(" in ", 1)[1].removesuffix(" s")) for d in downs]


def socket_supervisor(
    engine: FakeEngine, sockets: list[str]
) -> tuple[EngineSupervisor, list[EngineStatus]]:
    """A supervisor of *engine* that checks the schedulers' control *sockets* (its health
    probes always answer 200)."""
    seen: list[EngineStatus] = []

    async def healthy(url: str, timeout_s: float) -> int:
        return 200

    supervisor = EngineSupervisor(
        cast(EngineProcess, engine),
        FAST,
        on_status=seen.append,
        probe=healthy,
        scheduler_sockets=sockets,
    )
    return supervisor, seen


async def test_an_engine_that_lost_a_scheduler_is_killed_and_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler process dies while the engine's main process runs on (SGLang does not
    notice; every request reaching that scheduler hangs, and its health probe took 3 × 25 s to
    give up on a real engine): the scheduler's control socket refusing connections is enough."""
    sockets = [str(tmp_path / "engine.sock"), str(tmp_path / "engine.sock.dp1")]
    servers = []
    for path in sockets:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen()
        servers.append(server)
    checked: list[str] = []  # every socket check the supervisor made

    def counted(path: str) -> bool:
        checked.append(path)
        return socket_server_gone(path)

    monkeypatch.setattr(supervisor_module, "socket_server_gone", counted)
    engine = FakeEngine()
    supervisor, seen = socket_supervisor(engine, sockets)
    task = asyncio.create_task(supervisor.run())
    try:
        await wait_until(lambda: seen and seen[-1].phase == "up", 5, what="supervising")
        await wait_until(lambda: len(checked) >= 6, 10, what="three rounds of socket checks")
        assert engine.killed == []  # both schedulers there: nothing happens
        servers[1].close()  # DP rank 1's scheduler is gone; its socket file stays, refusing
        await wait_until(lambda: supervisor.status.restarts == 1, 5, what="a restart")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        servers[0].close()
    down = next(s.detail for s in seen if s.phase == "down")
    assert "lost the scheduler of its DP rank 1" in down and "refuses connections" in down
    assert engine.killed == [100]


def test_a_socket_whose_server_is_busy_still_counts_as_there(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    assert socket_server_gone(path)  # no file
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)  # a backlog that fills at once: the server is there, just not accepting
    held = []
    try:
        for _ in range(4):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.setblocking(False)
            conn.connect_ex(path)
            held.append(conn)
        assert not socket_server_gone(path)
    finally:
        for conn in held:
            conn.close()
        server.close()
    assert socket_server_gone(path)  # the file stays, nothing listens


async def test_a_main_process_that_dies_with_its_scheduler_is_reported_as_its_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killing the main process takes its scheduler down too, and on a busy machine the
    scheduler's socket can close before the main process's exit is seen: the report names the
    exit (the cause), not the lost socket (the symptom), and nothing is killed twice."""
    path = str(tmp_path / "engine.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    gone_seen = 0  # socket checks that found the scheduler gone

    def counted(checked: str) -> bool:
        nonlocal gone_seen
        gone = socket_server_gone(checked)
        gone_seen += gone
        return gone

    monkeypatch.setattr(supervisor_module, "socket_server_gone", counted)
    engine = FakeEngine()
    supervisor, seen = socket_supervisor(engine, [path])
    task = asyncio.create_task(supervisor.run())
    try:
        await wait_until(lambda: seen and seen[-1].phase == "up", 5, what="supervising")
        server.close()  # the scheduler went first ...
        await wait_until(lambda: gone_seen >= 1, 10, what="the lost socket noticed")
        engine.die(-9)  # ... and its main process's exit is seen a moment later
        await wait_until(lambda: supervisor.status.restarts == 1, 10, what="a restart")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    down = next(s.detail for s in seen if s.phase == "down")
    assert down.startswith("engine pid 100 exited: killed by SIGKILL (status -9)"), down
    assert engine.killed == []
