"""Who owns a local socket: is a TCP port free to listen on (and which one to start a server
on), does a server still accept on a Unix socket file, and which process holds one (a process of
the same user: its pid and command line, read from ``/proc``). Standard library only: `tandem
serve` checks its ports and its engine's control socket with it before it starts anything, and
the engine's control endpoint (``backend/sglang_ext/control.py``) refuses to take over a live
socket with it.

Binding a port another process listens on fails late and badly otherwise: SGLang's server dies
while its health check is answered by the other process (so the launcher takes it for ready and
the gateway fronts a stranger), and the gateway's own bind fails after the engine has started.
A control socket is a file: a second engine would replace the first one's, which then can never
be reached again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux says which ports it gives to outgoing connections and to binds to port 0."""
FREE_PORT_SPAN = 12_000
"""How many ports below the ephemeral range `free_port` picks from."""
_handed_out: set[int] = set()  # ports free_port returned in this process
_chooser = random.Random()  # seeded from the OS: processes pick differently


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on *host* that a server could listen on a moment ago, never one this process
    handed out before; chosen at random below the kernel's ephemeral port range.

    A server started on it binds it seconds later (SGLang: 20–30 s of imports first). A port
    from a bind to port 0 lies in the ephemeral range, from which the kernel also picks the
    local port of every outgoing connection — a test's HTTP client, a database connection —
    and one of them took such a port before the engine bound it now and then ("address
    already in use" at engine start, about one start in twenty on a busy machine)."""
    top = _ephemeral_start()
    bottom = max(1024, top - FREE_PORT_SPAN)
    for _ in range(200):
        port = _chooser.randrange(bottom, top)
        if port not in _handed_out and port_holder(host, port) is None:
            _handed_out.add(port)
            return port
    with socket.socket() as sock:  # nothing free below the range: any free port
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_consecutive_ports(count: int, host: str = "127.0.0.1") -> int:
    """A port p such that p … p + count − 1 were free a moment ago (`free_port` for p): an
    engine pool of *count* replicas on one host takes consecutive ports."""
    if count < 1:
        raise ValueError(f"count must be ≥ 1, got {count}")
    for _ in range(50):
        port = free_port(host)
        if all(port_holder(host, port + i) is None for i in range(1, count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768, Linux's default, elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_holder(host: str, port: int) -> str | None:
    """None when a TCP server could listen on *host*:*port* now; else why not, in words: "held
    by pid 123 (python -m http.server 8000)" when the holder is known, else the OS error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As servers bind (aiohttp, uvicorn): connections in TIME_WAIT do not count as in use.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            holder = describe_pids(_pids_holding(_listening_inodes(port)))
            return f"held by {holder}" if holder else (exc.strerror or str(exc))
    return None


def port_error(key: str, host: str, port: int) -> str | None:
    """One line naming *key* (the config key, e.g. "gateway.port") when *host*:*port* is not
    free, else None."""
    why = port_holder(host, port)
    return None if why is None else f"{key} {port} on {host} is already in use ({why})"


def socket_is_live(path: str | Path) -> bool:
    """Whether a server accepts connections on the Unix socket *path* (False for no file, or a
    stale file whose server is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(2.0)
        try:
            conn.connect(str(path))
        except OSError:
            return False
    return True


def socket_server_gone(path: str | Path) -> bool:
    """Whether the Unix socket *path* has no server any more: the file is missing or refuses
    connections. A server too busy to accept (its backlog full) still counts as there — a hung
    scheduler is the health probe's to find, never a false restart here. Never blocks."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.setblocking(False)
        error = conn.connect_ex(str(path))
    return error in (errno.ECONNREFUSED, errno.ENOENT)


def socket_holder(path: str | Path) -> str:
    """The process serving the Unix socket *path*, in words ("pid 123 (...)"), or "another
    process" when it cannot be told (another user's)."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == str(path):
                inodes.add(fields[6])
    return describe_pids(_pids_holding(inodes)) or "another process"


def control_socket_error(path: str | Path) -> str | None:
    """One line when *path* is the live control socket of an engine already running (a second
    engine must not take it over), else None (no file, or a stale one)."""
    if not socket_is_live(path):
        return None
    return (
        f"engine.control_socket {path} is in use by a running engine ({socket_holder(path)}); "
        "stop it or set engine.control_socket to another path"
    )


def remove_stale_socket(path: str | Path) -> bool:
    """Removes the Unix socket file *path* unless a server still accepts on it; whether it
    removed one (what an engine leaves behind when it is killed)."""
    if socket_is_live(path):
        return False
    with contextlib.suppress(FileNotFoundError):
        Path(path).unlink()
        return True
    return False


def describe_pids(pids: list[int]) -> str:
    """ "pid 123 (python -m x)" for each pid, comma-separated ("" for none)."""
    return ", ".join(f"pid {pid} ({_cmdline(pid)})" for pid in pids)


def _cmdline(pid: int, max_chars: int = 120) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP *port* (any address), from /proc/net/tcp{,6}."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # local_address is HEXADDR:HEXPORT; state 0A is LISTEN
                is_listening = len(fields) >= 10 and fields[3] == "0A"
                if is_listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def _pids_holding(inodes: set[str]) -> list[int]:
    """The processes (of those this user may inspect) with a descriptor on one of *inodes*."""
    if not inodes:
        return []
    targets = {f"socket:[{inode}]" for inode in inodes}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.scandir(entry / "fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in targets:
                        pids.append(int(entry.name))
                        break
    return sorted(pids)
