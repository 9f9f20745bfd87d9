"""The patched scheduler's control endpoint: HTTP over a Unix socket, in a daemon thread.

The gateway keeps output-length histories in SQL; the engine's policy needs them in memory.
This endpoint (on ``EngineSettings.control_socket``) lets the gateway push them
(``POST /length-history``, body :class:`~common.wire.LengthHistoryPush`), lets operators and
the bench read the policy's counters (``GET /stats``, with the name of the latency profile the
policy plans with and ``profile_matches``: whether it was measured on this engine, null when the
engine's key is unknown) and lets the gateway's SLO admission follow the engine's live state
(``GET /load?after=N&wait_s=S``, a long poll answered from the driver's
:class:`~backend.sglang_ext.load_board.LoadBoard` once iteration N+1 has run: each request has
its own server thread, blocked on the board's condition variable). It runs beside SGLang's
scheduler loop in the scheduler process: a push is only queued here and applied by the loop at
its next iteration, so the policy is never touched from two threads. A Unix socket (mode 0600)
rather than a TCP port: nothing but the same user on the same host can reach it, and there is no
port to collide with.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec

from backend.sglang_ext.driver import EngineDriver
from common.sockets import control_socket_error, remove_stale_socket
from common.wire import (
    CONTROL_HEALTH_PATH,
    CONTROL_ITERATIONS_PATH,
    CONTROL_LENGTHS_PATH,
    CONTROL_LOAD_PATH,
    CONTROL_STATS_PATH,
    CONTROL_STATS_RESET_PATH,
    LengthHistoryPush,
    load_query,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
"""Largest push accepted (a full window of 1,000 lengths for tens of thousands of keys)."""


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    driver: EngineDriver

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left before its reply (a gateway stopping in a long poll) is routine:
        one debug line, where socketserver would print a traceback on the engine's console."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            logger.debug("control: the client went away before its reply (%s)", exc)
        else:
            logger.exception("control: a request failed")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path in (CONTROL_LOAD_PATH, CONTROL_ITERATIONS_PATH):
            try:
                query = parse_qs(url.query)
                after, wait_s = load_query(
                    query.get("after", [None])[0], query.get("wait_s", [None])[0]
                )
            except ValueError as exc:
                self._reply(400, {"error": str(exc)})
                return
            board = self.server.driver.loads
            if url.path == CONTROL_LOAD_PATH:
                self._reply_bytes(200, msgspec.json.encode(board.wait_after(after, wait_s)))
            else:
                self._reply_bytes(200, msgspec.json.encode(board.iterations_after(after, wait_s)))
        elif self.path == CONTROL_STATS_PATH:
            from backend.sglang_ext.kv_layout_engine import stats as kv_layout_stats

            driver = self.server.driver
            profile = {"profile": driver.profile, "profile_matches": driver.profile_matches}
            self._reply(200, {**driver.stats.summary(), **kv_layout_stats(), **profile})
        elif self.path == CONTROL_HEALTH_PATH:
            self._reply(200, {"status": "ok", "boot_id": self.server.driver.boot_id})
        else:
            self._reply(404, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:
        if self.path == CONTROL_STATS_RESET_PATH:
            self.server.driver.reset_stats()
            self._reply(200, {"status": "reset"})
            return
        if self.path != CONTROL_LENGTHS_PATH:
            self._reply(404, {"error": f"no route POST {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._reply(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
            return
        try:
            push = msgspec.json.decode(self.rfile.read(length), type=LengthHistoryPush)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._reply(400, {"error": f"bad length-history push: {exc}"})
            return
        self.server.driver.push_lengths(push.histories)
        self._reply(
            202,
            {"keys": len(push.histories), "lengths": sum(len(v) for v in push.histories.values())},
        )

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        self._reply_bytes(status, json.dumps(body).encode())

    def _reply_bytes(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def address_string(self) -> str:  # a Unix socket has no client address
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("control: " + format, *args)


def start(driver: EngineDriver, socket_path: str) -> socketserver.BaseServer:
    """Serves the control endpoint on *socket_path* in a daemon thread. A stale socket file
    from an earlier engine is replaced; a live one (another engine serves it) never is: raises
    RuntimeError, and the engine does not start."""
    path = Path(socket_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    problem = control_socket_error(path)
    if problem is not None:
        raise RuntimeError(problem)
    remove_stale_socket(path)
    server = _Server(str(path), _Handler)
    server.driver = driver
    os.chmod(path, 0o600)
    thread = threading.Thread(target=server.serve_forever, name="tandem-control", daemon=True)
    thread.start()
    logger.info("tandem control endpoint on %s", path)
    return server
