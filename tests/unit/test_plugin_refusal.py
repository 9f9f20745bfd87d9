"""An engine whose control socket another running engine serves stops in its main process, at
the plugin's first load, naming the socket and its holder — not 20 s later in its scheduler —
and a stale socket file or none lets it start (the scheduler replaces a stale one)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from backend.sglang_ext.plugin import refuse_taken_socket
from common.config import EngineSettings


def settings(path: Path) -> EngineSettings:
    return EngineSettings(policy="tandem", profile_path="profile.json", control_socket=str(path))


def test_a_live_control_socket_stops_the_engine_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(SystemExit) as stopped:
            refuse_taken_socket(settings(path))
    message = str(stopped.value)
    assert f"engine.control_socket {path} is in use by a running engine" in message
    assert f"pid {os.getpid()}" in message  # who holds it


def test_a_stale_socket_file_or_none_lets_it_start(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))  # closed without unlink: what a killed engine leaves behind
    refuse_taken_socket(settings(stale))
    refuse_taken_socket(settings(tmp_path / "none.sock"))
    refuse_taken_socket(EngineSettings())  # no policy: no control endpoint
    assert stale.exists()  # the scheduler replaces it, not the main process
