"""`tandem serve` refuses, at once and in one line, what it cannot have: a port another process
listens on, or the control socket of an engine already running (issue 17). Nothing is started
first: no engine process, no database.

Before: with the engine's port taken, the other process answered the launcher's health check
("engine ready") and the gateway fronted it, while the new engine died after replacing the
running engine's control socket; with the gateway's port taken, a traceback after the engine had
started."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.launch.sglang import EngineStartError
from common.sockets import free_port, remove_stale_socket
from tests.functional.engine_fixtures import running_engine
from tests.functional.test_serve import engine_pids

EXIT_TIMEOUT_S = 120.0
"""`tandem serve` exits within this long when it refuses (seconds; it takes about one: Python's
start-up). Without the checks it serves on, and the test fails here."""


class _Health(http.server.BaseHTTPRequestHandler):
    """Another HTTP server on the port, answering `GET /health` like an engine would."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[int]:
    """The port of a server this test process runs (as another program holding it would)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def serve(tmp_path: Path, **env_overrides: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN="preflight-admin-token",
        TANDEM_GATEWAY__PORT=str(free_port()),
        TANDEM_ENGINE__PORT=str(free_port()),
        TANDEM_DATABASE__URL=f"sqlite:///{tmp_path / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp_path / "cache"),
        TANDEM_ENGINE__LOG_FILE=str(tmp_path / "engine.log"),
        TANDEM_ENGINE__SKIP_PROFILE="true",
        TANDEM_ENGINE__CONTROL_SOCKET=str(tmp_path / "control.sock"),
    )
    env.update(env_overrides)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # its engine dies with it (parent-death signal)
        out, err = proc.communicate()
        pytest.fail(f"tandem serve did not refuse; it ran on:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """One line on stderr naming *words*, a non-zero exit, no traceback; the line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_engine_port_taken(tmp_path: Path, other_server: int) -> None:
    result = serve(tmp_path, TANDEM_ENGINE__PORT=str(other_server))
    assert_refused(result, f"engine.port {other_server}", f"pid {os.getpid()}")
    assert engine_pids(other_server) == []
    assert not (tmp_path / "serve.db").exists()  # nothing started: not even the migration


def test_gateway_port_taken(tmp_path: Path, other_server: int) -> None:
    engine_port = free_port()
    result = serve(
        tmp_path, TANDEM_GATEWAY__PORT=str(other_server), TANDEM_ENGINE__PORT=str(engine_port)
    )
    assert_refused(result, f"gateway.port {other_server}", f"pid {os.getpid()}")
    assert engine_pids(engine_port) == []


def test_live_control_socket_is_never_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        result = serve(tmp_path, TANDEM_ENGINE__CONTROL_SOCKET=str(path))
        assert_refused(result, f"engine.control_socket {path}", f"pid {os.getpid()}")
        # still the running engine's: a client reaches it
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))


def test_a_stale_control_socket_is_removed_a_live_one_kept(tmp_path: Path) -> None:
    stale, live_path = tmp_path / "stale.sock", tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))  # closed without unlink: what a killed engine leaves behind
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(live_path))
        live.listen()
        assert remove_stale_socket(stale) and not stale.exists()
        assert not remove_stale_socket(live_path) and live_path.exists()


@pytest.mark.slow
def test_an_engine_never_takes_over_a_live_control_socket(tmp_path: Path) -> None:
    """An engine started some other way (a test, a study) with the socket of a running one:
    it does not start (before: it replaced the socket, or, failing, ran on without one). Its
    main process refuses, before SGLang starts a scheduler (6 s here, against 19 s when only
    the scheduler looked)."""
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        with (
            pytest.raises(EngineStartError, match="exited") as failed,
            running_engine(tmp_path, control_socket=str(path)),
        ):
            pass
        assert f"engine.control_socket {path} is in use by a running engine" in str(failed.value)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
