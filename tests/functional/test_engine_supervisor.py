"""The engine supervisor on real processes: the stand-in engine of test_engine_launcher.py (fast:
no SGLang), SIGKILLed or frozen with SIGSTOP, is reaped — no zombie left — and restarted, and
the supervisor reports each step. tests/functional/test_serve_supervised.py does the same to
the real engine under `tandem serve`."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from backend.launch.supervisor import EngineStatus, EngineSupervisor, RestartPolicy
from tests.functional.test_engine_launcher import fake_engine, is_alive
from tests.waiting import wait_until

POLICY = RestartPolicy(
    backoff_s=0.1,
    backoff_max_s=1.0,
    stable_s=60.0,
    startup_timeout_s=60.0,
    probe_interval_s=0.2,
    probe_timeout_s=0.5,
    probe_failures=2,
)


def is_reaped(pid: int) -> bool:
    """Gone for good: neither running nor a zombie waiting for its parent's wait()."""
    return not Path(f"/proc/{pid}").exists()


async def test_a_killed_engine_is_reaped_and_restarted(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, delay_s=0.2)
    seen: list[EngineStatus] = []
    supervisor = EngineSupervisor(engine, POLICY, on_status=seen.append)
    engine.start()
    task = None
    try:
        await engine.wait_ready(timeout_s=60)
        first_pid = engine.pid
        assert first_pid is not None
        task = asyncio.create_task(supervisor.run())
        await wait_until(lambda: seen and seen[-1].phase == "up", 10, what="supervising")

        os.kill(first_pid, signal.SIGKILL)
        down = await wait_until(
            lambda: next((s for s in seen if s.phase == "down"), None), 10, what="the death seen"
        )
        assert "killed by SIGKILL (status -9)" in down.detail and str(first_pid) in down.detail
        assert is_reaped(first_pid)  # reaped when its death was noticed, before any restart

        await wait_until(lambda: supervisor.status.restarts == 1, 60, what="the restart")
        assert supervisor.status.is_serving
        assert engine.is_running and engine.pid not in (None, first_pid)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        engine.stop()
    assert [s.phase for s in seen] == ["up", "down", "restarting", "up", "stopped"]


async def test_a_frozen_engine_is_killed_and_restarted(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, delay_s=0.2)
    seen: list[EngineStatus] = []
    supervisor = EngineSupervisor(engine, POLICY, on_status=seen.append)
    engine.start()
    task = None
    try:
        await engine.wait_ready(timeout_s=60)
        frozen_pid = engine.pid
        assert frozen_pid is not None
        task = asyncio.create_task(supervisor.run())
        os.kill(frozen_pid, signal.SIGSTOP)  # alive, but answers nothing: a hung engine
        await wait_until(lambda: supervisor.status.restarts == 1, 60, what="the restart")
        assert not is_alive(frozen_pid)
        assert is_reaped(frozen_pid)
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        engine.stop()
    phases = [s.phase for s in seen]
    assert phases[:3] == ["up", "unresponsive", "down"], phases
    down = next(s for s in seen if s.phase == "down")
    assert "failed 2 health probes in a row" in down.detail
    assert "killed by SIGKILL" in down.detail


def test_a_stopped_engine_is_never_signalled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pids are reused (this machine's pid_max is 32768): once the engine's process is reaped,
    the id of its process group may name another process's group, so a second stop() or a
    kill() (a supervisor's, an atexit handler's) must not signal it."""
    engine = fake_engine(tmp_path, delay_s=0.2)
    engine.start()
    engine.wait_ready_sync(timeout_s=60)
    engine.stop()
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: signalled.append((pgid, sig)))
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    engine.stop()
    engine.kill()
    assert signalled == []
