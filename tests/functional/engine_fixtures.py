"""The real engine for functional tests: patched SGLang on CPU with the tiny model, one per session.

``engine_server`` builds the tiny model into a session temp dir, starts the server on a free port
with tandem's plugin and its scheduler trace enabled, waits until ``/health`` answers, and stops
the whole process group at session end — also when start-up fails or a test crashes (and the
launcher's parent-death signal covers a killed pytest). Tests that use it are ``slow``.

Also here: small stdlib HTTP helpers that speak SGLang's native API (JSON and SSE streams).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backend.launch.sglang import EngineProcess, engine_base_url, engine_env, server_argv
from backend.launch.tiny_model import ensure_tiny_model
from common.config import EngineConfig
from common.sockets import free_port, remove_stale_socket

MODEL_NAME = "tandem-tiny"
STARTUP_TIMEOUT_S = 240.0  # 15-30 s on an idle 2-core machine; generous for a loaded CI box
HTTP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineServer:
    """A running engine, as the tests see it."""

    base_url: str
    """``http://127.0.0.1:<port>``."""
    port: int
    """The engine's HTTP port."""
    model_path: Path
    """The tiny model directory the engine serves (also the tokenizer for clients)."""
    model_name: str
    """The served model name (``model`` in OpenAI requests)."""
    trace_path: Path
    """The scheduler's debug trace (JSON lines, one per created request)."""
    log_path: Path
    """The engine's stdout and stderr."""
    pid: int
    """The engine's main process id (the HTTP server; the scheduler is a child)."""
    config: EngineConfig
    """The configuration the engine was started with."""

    def read_trace(self) -> list[dict[str, Any]]:
        """Every record the scheduler has written so far."""
        if not self.trace_path.exists():
            return []
        lines = self.trace_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def trace_for(self, rid: str) -> dict[str, Any]:
        """The one trace record of request *rid* (fails the test when it is not exactly one)."""
        records = [r for r in self.read_trace() if r["rid"] == rid]
        assert len(records) == 1, f"expected one trace record for {rid}, got {records}"
        return records[0]


CPU_POLICY_OPTIONS: dict[str, float | int | bool | str] = {
    "latency_budget_s": 0.2,
    "idle_budget_s": 0.5,
}
"""The tandem policy's time budgets the engine tests were written for (config.yaml ships
tighter ones for RT latency beside BE — a 50 ms BE-alone iteration and `rt_stretch` — which
tests/functional/test_new_user.py runs)."""


@contextlib.contextmanager
def running_engine(
    workdir: Path, model_path: Path | None = None, **overrides: Any
) -> Iterator[EngineServer]:
    """A patched engine on a free port, stopped on exit (also on errors): the tiny model with
    random weights, or the model in *model_path* with its own. *overrides* are EngineConfig
    fields."""
    random_weights = model_path is None
    if model_path is None:
        model_path = ensure_tiny_model(workdir / "model-cache")
    trace_path = workdir / "scheduler-trace.jsonl"
    log_path = workdir / "engine.log"
    fields: dict[str, Any] = {
        "port": free_port(),
        "patch": True,
        "max_total_tokens": 16384,
        "max_running_requests": 16,
        "chunked_prefill_size": 512,
        "policy_options": CPU_POLICY_OPTIONS,
    }
    fields.update(overrides)
    cfg = EngineConfig(**fields)
    engine = EngineProcess(
        server_argv(cfg, model_path, MODEL_NAME, random_weights=random_weights),
        engine_env(cfg, scheduler_trace=trace_path),
        base_url=engine_base_url(cfg),
        log_path=log_path,
    )
    engine.start()
    try:
        engine.wait_ready_sync(STARTUP_TIMEOUT_S)
        assert engine.pid is not None
        yield EngineServer(
            base_url=engine.base_url,
            port=cfg.port,
            model_path=model_path,
            model_name=MODEL_NAME,
            trace_path=trace_path,
            log_path=log_path,
            pid=engine.pid,
            config=cfg,
        )
    finally:
        engine.stop()
        remove_stale_socket(cfg.control_socket_path)  # its killed scheduler left it


@pytest.fixture(scope="session")
def engine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    """The patched engine (tandem's policy in charge), started once per session, always
    stopped. Small enough to start fast on 2 cores, big enough for every engine test."""
    with running_engine(tmp_path_factory.mktemp("engine")) as engine:
        yield engine


def post_json(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POSTs *body*; returns (status, parsed JSON body or raw text)."""
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, _parse(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _parse(err.read())


def get_json(base_url: str, path: str) -> tuple[int, Any]:
    """GETs *path*; returns (status, parsed JSON body or raw text)."""
    try:
        with urllib.request.urlopen(base_url + path, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, _parse(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _parse(err.read())


def stream_events(base_url: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POSTs a streaming request and yields each SSE ``data:`` chunk, up to ``[DONE]``."""
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        assert resp.status == 200, resp.status
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str) -> None:
        super().__init__("engine", timeout=HTTP_TIMEOUT_S)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(HTTP_TIMEOUT_S)
        sock.connect(self.socket_path)
        self.sock = sock


def control(engine: EngineServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """A request to the engine's control endpoint (Unix socket); (status, parsed body)."""
    conn = _UnixHTTPConnection(engine.config.control_socket_path)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, _parse(resp.read())
    finally:
        conn.close()


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")
