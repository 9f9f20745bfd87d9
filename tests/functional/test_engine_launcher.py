"""EngineProcess lifecycle, with a stand-in server instead of SGLang (fast: no engine start).

The stand-in behaves like SGLang's launcher where it matters: it answers ``GET /health`` after
a delay, has a child process of its own (like the scheduler), and can ignore SIGTERM or die
during start-up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backend.launch.sglang import EngineProcess, EngineStartError
from common.sockets import free_port
from tests.waiting import wait_until_sync

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    port, delay_s, mode, pid_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    # Like SGLang's scheduler: a child that asks to be SIGKILLed when its parent dies (its sleep
    # is the behaviour: it lives until killed).
    child_code = "import ctypes, time; ctypes.CDLL(None).prctl(1, 9); time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", child_code])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "crash":
        print("fake engine: cannot load the model", flush=True)
        sys.exit(3)
    time.sleep(delay_s)  # the behaviour under test: an engine that takes delay_s to start

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


def fake_engine(tmp_path: Path, mode: str = "ok", delay_s: float = 0.5) -> EngineProcess:
    port = free_port()
    argv = [
        sys.executable,
        "-c",
        FAKE_SERVER,
        str(port),
        str(delay_s),
        mode,
        str(tmp_path / "child"),
    ]
    return EngineProcess(
        argv, dict(os.environ), base_url=f"http://127.0.0.1:{port}", log_path=tmp_path / "log"
    )


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait() is missing


def wait_until_dead(pid: int, timeout_s: float = 10.0) -> bool:
    return wait_until_sync(lambda: not is_alive(pid), timeout_s, what=f"process {pid} exited")


def child_pid(tmp_path: Path) -> int:
    def written() -> str | None:
        path = tmp_path / "child"
        return path.read_text() if path.exists() else None

    return int(wait_until_sync(written, 10, what="the fake engine started its child"))


def test_start_wait_stop_takes_the_whole_group(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path)
    with engine:
        engine.wait_ready_sync(timeout_s=30)
        assert engine.is_running and engine.pid is not None
        grandchild = child_pid(tmp_path)
        assert os.getpgid(grandchild) == engine.pid  # its own group, which holds the child too
    assert not engine.is_running
    assert wait_until_dead(grandchild)


def test_async_wait_ready(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, delay_s=1.0)
    engine.start()
    try:
        asyncio.run(engine.wait_ready(timeout_s=30))
    finally:
        engine.stop()


def test_a_crash_during_start_fails_fast_with_the_log_tail(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, mode="crash")
    engine.start()
    started = time.monotonic()
    with pytest.raises(EngineStartError, match="exited with code 3") as err:
        engine.wait_ready_sync(timeout_s=60)
    assert time.monotonic() - started < 30
    assert "cannot load the model" in str(err.value)


def test_not_ready_in_time(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, delay_s=60)
    engine.start()
    try:
        with pytest.raises(EngineStartError, match="not healthy after"):
            engine.wait_ready_sync(timeout_s=1)
    finally:
        engine.stop()


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, mode="ignore-term")
    engine.start()
    engine.wait_ready_sync(timeout_s=30)
    assert engine.stop(timeout_s=1) == -signal.SIGKILL
    assert wait_until_dead(child_pid(tmp_path))


def test_the_engine_dies_with_its_parent(tmp_path: Path) -> None:
    # A parent that starts an engine and is then SIGKILLed: no cleanup code of it runs.
    parent_code = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from tests.functional.test_engine_launcher import fake_engine
        from pathlib import Path
        engine = fake_engine(Path({str(tmp_path)!r}))
        engine.start()
        engine.wait_ready_sync(timeout_s=30)
        print(engine.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", parent_code], capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL, out.stderr
    engine_pid = int(out.stdout.strip())
    assert wait_until_dead(engine_pid), "the engine outlived its parent"
    assert wait_until_dead(child_pid(tmp_path))
