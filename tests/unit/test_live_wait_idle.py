"""The live bench's wait for an idle engine between real λ* probes (bench.live._wait_idle): it
reads the engine's /v1/loads with the engine's key, waits while requests run, and takes a
refusal for an error, never for "idle" (a 401 once ended every wait at once)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.live import _wait_idle, engine_headers

KEY = "engine-key"


class _Engine:
    """A stand-in for SGLang's /v1/loads: `busy_reads` answers with a running request, then
    idle; requests without the key get a 401."""

    def __init__(self, busy_reads: int) -> None:
        self.busy_reads = busy_reads
        self.reads = 0

    def answer(self, authorization: str | None) -> tuple[int, dict[str, object]]:
        if authorization != f"Bearer {KEY}":
            return 401, {"error": "Unauthorized"}
        self.reads += 1
        running = 1 if self.reads <= self.busy_reads else 0
        return 200, {"loads": [{"num_running_reqs": running, "num_waiting_reqs": 0}]}


@pytest.fixture
def serve() -> Iterator[Callable[[_Engine], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(engine: _Engine) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = engine.answer(self.headers.get("Authorization"))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_it_waits_while_the_engine_runs_requests(serve: Callable[[_Engine], str]) -> None:
    engine = _Engine(busy_reads=2)
    _wait_idle(serve(engine), engine_headers({"api_key": KEY}), timeout_s=30, poll_s=0.01)
    assert engine.reads == 3  # busy, busy, idle


def test_a_refused_read_is_an_error_not_idle(serve: Callable[[_Engine], str]) -> None:
    url = serve(_Engine(busy_reads=0))
    with pytest.raises(RuntimeError, match="answered HTTP 401"):
        _wait_idle(url, engine_headers({}), timeout_s=30, poll_s=0.01)
