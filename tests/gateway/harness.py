"""The fast gateway tier's harness: the real gateway app and the simulator's SGLang-compatible HTTP
server, both served in this process on port 0, and a client that speaks only HTTP to them.

Nothing here reaches into the gateway's internals: tests see status codes, headers and bodies, as
a user or an operator would, so they survive refactors of gateway/api, gateway/batch and
gateway/store. Usage records are read through ``GET /admin/v1/requests`` (polled until the
recorder has written them), metrics through ``GET /metrics``.
"""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from backend.policy.profiles import resolve_profile
from backend.sim.server import create_sim_app_from_profile
from common.config import load_config
from gateway.app import create_app
from gateway.engine.load import LoadWatcher
from gateway.state import LOADS
from gateway.store import upgrade_async
from tests.waiting import wait_until

ADMIN_TOKEN = "test-admin-token"
MODEL = "tandem-tiny"
SIM_PROFILE = "h100-llama8b-analytic"
SIM_TIME_SCALE = 0.2
"""The simulator's iterations take a fifth of the profile's (H100) time: a few ms each."""

FAST_BACKGROUND = {
    "TANDEM_USAGE__FLUSH_INTERVAL_S": "0.02",  # usage records reach SQL within ~20 ms
    "TANDEM_BATCH__POLL_INTERVAL_S": "0.02",  # the batch runner notices new batches at once
    "TANDEM_BATCH__RETRY_AFTER_S": "0.05",
    "TANDEM_METRICS__ENGINE_POLL_S": "0.05",  # the engine gauges on /metrics are fresh
    # client and gateway share one loop here: on a loaded machine a burst of a test's requests
    # can wait past the default 1 s to be read, and a 503 would fail a test of something else
    # (tests/gateway/test_connections.py tests the queue-wait shed with its own bound)
    "TANDEM_GATEWAY__MAX_QUEUE_WAIT_S": "60",
}
"""Config overrides that make the gateway's background loops react within tens of ms."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass
class Reply:
    """An HTTP answer: status, headers and the body (parsed JSON, else text)."""

    status: int
    headers: CIMultiDict[str]
    """Case-insensitive, as HTTP's header names are."""
    body: Any

    @property
    def error(self) -> dict[str, Any]:
        """The OpenAI error object of an error answer."""
        assert isinstance(self.body, dict) and "error" in self.body, self
        return dict(self.body["error"])


@dataclass
class Gateway:
    """A running gateway (in front of the in-process simulator) and an HTTP client for it."""

    base_url: str
    engine_url: str
    """The simulator's base URL (``/v1/loads`` shows what runs on the engine)."""
    session: aiohttp.ClientSession
    database_url: str
    _server: TestServer | None = None
    _names: dict[str, int] = field(default_factory=dict)

    async def stop(self) -> None:
        """Stops the gateway as SIGTERM does (it drains the requests in flight first:
        gateway/shutdown.py); returns once it has stopped."""
        assert self._server is not None
        await self._server.close()

    # -- plain HTTP -------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        key: str | None = None,
        admin: bool = False,
        json_body: Any = None,
        data: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One request to the gateway; *key* authenticates as a tenant, *admin* as the
        operator."""
        all_headers = dict(headers or {})
        if key is not None:
            all_headers["Authorization"] = f"Bearer {key}"
        if admin:
            all_headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        async with self.session.request(
            method, self.base_url + path, json=json_body, data=data, headers=all_headers
        ) as resp:
            raw = await resp.read()
            return Reply(resp.status, CIMultiDict(resp.headers), _parse(raw))

    async def admin(self, method: str, path: str, body: Any = None) -> Reply:
        """A call of the admin API (``/admin/v1`` + *path*) with the admin token."""
        return await self.request(method, "/admin/v1" + path, admin=True, json_body=body)

    async def chat(self, key: str, content: str = "hi", **fields: Any) -> Reply:
        """``POST /v1/chat/completions`` with one user message; *fields* extend the body."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
        return await self.request("POST", "/v1/chat/completions", key=key, json_body=body)

    async def completion(self, key: str, prompt: str = "hi", **fields: Any) -> Reply:
        body = {"model": MODEL, "prompt": prompt, **fields}
        return await self.request("POST", "/v1/completions", key=key, json_body=body)

    async def stream(self, path: str, key: str, body: dict[str, Any]) -> tuple[Reply, list[str]]:
        """A streaming request; the answer (body: None) and every SSE ``data:`` payload, raw, in
        order (the last one of a complete stream is ``[DONE]``)."""
        events: list[str] = []
        async with self.session.post(
            self.base_url + path,
            json={**body, "stream": True},
            headers={"Authorization": f"Bearer {key}"},
        ) as resp:
            if resp.status != 200:
                return Reply(resp.status, CIMultiDict(resp.headers), _parse(await resp.read())), []
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    events.append(line[len("data:") :].strip())
            return Reply(resp.status, CIMultiDict(resp.headers), None), events

    # -- operator helpers -------------------------------------------------------------------

    def unique(self, name: str) -> str:
        """*name*, made unique within this gateway (tenant names must be)."""
        n = self._names.get(name, 0)
        self._names[name] = n + 1
        return name if n == 0 else f"{name}-{n}"

    async def new_tenant(
        self, name: str, tier: str = "rt", *, quota: dict[str, Any] | None = None, **slo: Any
    ) -> tuple[str, str]:
        """Creates a tenant (RT: generous SLO targets unless given) and a key; (id, key)."""
        if tier == "rt" and not slo:
            slo = {"ttft_ms": 10_000, "tpot_ms": 2_000}
        body: dict[str, Any] = {"name": self.unique(name), "tier": tier, "slo": slo}
        if quota is not None:
            body["quota"] = quota
        tenant = await self.admin("POST", "/tenants", body)
        assert tenant.status == 201, tenant
        key = await self.admin("POST", f"/tenants/{tenant.body['id']}/keys")
        assert key.status == 201, key
        return tenant.body["id"], key.body["key"]

    async def records(
        self, tenant_id: str, count: int = 1, timeout_s: float = 10.0
    ) -> list[dict[str, Any]]:
        """The tenant's newest usage records (newest first), once at least *count* of them are
        written (the recorder writes off the request path, so this polls)."""

        async def written() -> list[dict[str, Any]] | None:
            reply = await self.admin("GET", f"/requests?tenant={tenant_id}&limit=100")
            assert reply.status == 200, reply
            data = list(reply.body["data"])
            return data if len(data) >= count else None

        return await wait_until(written, timeout_s, what=f"{count} usage record(s)")

    async def metrics(self) -> Samples:
        """``GET /metrics``, parsed: (name, labels) → value."""
        async with self.session.get(self.base_url + "/metrics") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
        return samples

    async def engine_running(self) -> int:
        """Requests running or waiting on the simulator right now."""
        async with self.session.get(self.engine_url + "/v1/loads") as resp:
            body = await resp.json()
        return sum(
            int(r.get("num_running_reqs", 0)) + int(r.get("num_waiting_reqs", 0))
            for r in body["loads"]
        )


def metric(samples: Samples, series: str, /, **labels: str) -> float | None:
    """The value of one series of a scrape (None when it is absent)."""
    return samples.get((series, frozenset(labels.items())))


def sse_json(events: list[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream (everything before ``[DONE]``)."""
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


@asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[TestServer]:
    """*app* on 127.0.0.1, on a port the OS picks, in this event loop."""
    server = TestServer(app, host="127.0.0.1", port=0, handler_cancellation=True)
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


def sim_app(time_scale: float = SIM_TIME_SCALE) -> web.Application:
    """The simulator's HTTP app, as `engine.kind: sim` serves it (FCFS on the analytic H100
    profile), named like the gateway's model."""
    return create_sim_app_from_profile(
        resolve_profile(SIM_PROFILE), "fcfs", model_name=MODEL, time_scale=time_scale
    )


@asynccontextmanager
async def closed_port() -> AsyncIterator[int]:
    """A port where nothing listens (a bound, never-listening socket holds it): the engine down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


async def migrated_database(path: Path) -> Path:
    """A new SQLite database at *path*, upgraded to the newest migration."""
    await upgrade_async(f"sqlite:///{path}")
    return path


@asynccontextmanager
async def running_gateway(
    tmp_path: Path,
    model_dir: Path,
    engine_port: int,
    *,
    template_db: Path | None = None,
    loads: dict[str, LoadWatcher] | None = None,
    **env: str,
) -> AsyncIterator[Gateway]:
    """The gateway app on a fresh, migrated SQLite database in *tmp_path* (a copy of
    *template_db*, a database `migrated_database` made, when given: faster than migrating), in
    front of the engine at *engine_port*; *env* are ``TANDEM_*`` config overrides. *loads*: the
    engine states the SLO admission reads (hand-built: the test sets each watcher's `latest`)."""
    db_path = tmp_path / "tandem.db"
    if template_db is not None:
        shutil.copyfile(template_db, db_path)
    db_url = f"sqlite:///{db_path}"
    environ = {
        "TANDEM_DATABASE__URL": db_url,
        "TANDEM_ENGINE__KIND": "sim",
        "TANDEM_ENGINE__LAUNCH": "false",
        "TANDEM_ENGINE__PORT": str(engine_port),
        **FAST_BACKGROUND,
        **env,
    }
    config = load_config(environ=environ)
    if template_db is None:
        await upgrade_async(config.database.url)
    app = create_app(config, ADMIN_TOKEN, model_dir)
    async with serve(app) as server, aiohttp.ClientSession() as session:
        if loads is not None:
            # Hand-built engine states replace the watcher the app started (it keeps polling the
            # engine, but the admission no longer reads it).
            app[LOADS].clear()
            app[LOADS].update(loads)
        yield Gateway(
            base_url=str(server.make_url("")).rstrip("/"),
            engine_url=f"http://127.0.0.1:{engine_port}",
            session=session,
            database_url=db_url,
            _server=server,
        )
