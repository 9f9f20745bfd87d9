"""The engine's control endpoint (Unix socket) when its client goes away mid-request: a gateway
stopping during a `/load` long poll left a BrokenPipeError traceback on the engine's console for
every poll (issue 17); now it is one debug line."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from backend.policy.types import Plan
from backend.sglang_ext import control
from backend.sglang_ext.driver import EngineDriver
from common.wire import CONTROL_LOAD_PATH
from tests.unit.test_engine_driver import ScriptedPolicy
from tests.waiting import wait_until_sync


def test_a_client_that_leaves_a_long_poll_is_one_debug_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "control.sock"
    server = control.start(EngineDriver(ScriptedPolicy(Plan())), str(path))  # type: ignore[arg-type]
    caplog.set_level(logging.DEBUG, logger=control.__name__)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            # no iteration ever runs here: the reply comes after wait_s, to a client long gone
            client.sendall(f"GET {CONTROL_LOAD_PATH}?after=5&wait_s=0.2 HTTP/1.1\r\n\r\n".encode())
        wait_until_sync(
            lambda: "went away" in caplog.text, 10, what="the endpoint noticed the client left"
        )
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err
