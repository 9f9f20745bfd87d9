"""What an engine's main process refuses before SGLang starts a scheduler (not 20 s later, in
the scheduler): a control socket another running engine serves, named with its holder (a stale
socket file or none lets it start: the scheduler replaces a stale one); and, with the bicache KV
layout, engine arguments the layout cannot take, named."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.sglang_ext.plugin import refuse_taken_socket, refuse_unfit_layout
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


def server_args(**fields: object) -> SimpleNamespace:
    """SGLang's ServerArgs as the bicache layout needs it, with *fields* changed."""
    return SimpleNamespace(
        **{"max_total_tokens": 16384, "page_size": 1, "disable_radix_cache": True, **fields}
    )


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"max_total_tokens": 1000}, "a KV pool of a multiple of 16 tokens, got 1000"),
        ({"page_size": 16}, "page size 1, not 16"),
        ({"disable_radix_cache": False}, "needs --disable-radix-cache"),
    ],
)
def test_engine_arguments_the_bicache_layout_cannot_take_stop_it_naming_them(
    fields: dict[str, object], problem: str
) -> None:
    with pytest.raises(SystemExit) as stopped:
        refuse_unfit_layout(server_args(**fields))
    assert problem in str(stopped.value)


def test_arguments_that_fit_or_leave_the_pool_to_sglang_pass() -> None:
    refuse_unfit_layout(server_args())
    refuse_unfit_layout(server_args(max_total_tokens=None, page_size=None))  # SGLang sizes it
