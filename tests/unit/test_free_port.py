"""`common.sockets.free_port`: the port a test or a bench starts a server on is chosen below the
kernel's ephemeral range, so no outgoing connection is given it before the server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from common import sockets
from common.sockets import free_port


def server_socket() -> socket.socket:
    """A socket that binds as servers do (aiohttp, uvicorn, SGLang): SO_REUSEADDR, so that a
    connection of an earlier server on the port, still in TIME_WAIT, does not hold it (what
    `port_holder` checks; a plain bind failed on such a port now and then)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def test_ports_lie_below_the_ephemeral_range_are_free_and_never_repeat() -> None:
    first_ephemeral = sockets._ephemeral_start()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(first_ephemeral - sockets.FREE_PORT_SPAN <= p < first_ephemeral for p in ports)
    for port in ports[:20]:
        with server_socket() as server:
            server.bind(("127.0.0.1", port))  # free a moment ago: a server can take it


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # a range of exactly the one port in use: it is refused, and the fallback (any port the
        # kernel gives a bind to port 0) is used instead
        (tmp_path / "range").write_text(f"{taken + 1}\t{taken + 100}\n")
        monkeypatch.setattr(sockets, "EPHEMERAL_RANGE_FILE", tmp_path / "range")
        monkeypatch.setattr(sockets, "FREE_PORT_SPAN", 1)
        port = free_port()
        assert port != taken
        with server_socket() as server:
            server.bind(("127.0.0.1", port))


def test_without_the_range_file_linux_defaults_are_assumed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sockets, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert sockets._ephemeral_start() == 32768
    assert 32768 - sockets.FREE_PORT_SPAN <= free_port() < 32768


def test_consecutive_ports_for_a_pool_are_all_free() -> None:
    first = sockets.free_consecutive_ports(3)
    servers = [server_socket() for _ in range(3)]
    try:
        for i, server in enumerate(servers):
            server.bind(("127.0.0.1", first + i))  # each free a moment ago
    finally:
        for server in servers:
            server.close()
    with pytest.raises(ValueError):
        sockets.free_consecutive_ports(0)
