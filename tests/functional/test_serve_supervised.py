"""`tandem serve` keeps serving when its engine dies (issue 16), on the real CPU engine.

One `tandem serve` for the module; each test SIGKILLs its engine (or tries to, with the inputs
that used to crash it) and checks what a client and an operator see:

* the engine SIGKILLed while a stream and a non-streaming request run on it: the stream ends
  with an error event and ``[DONE]`` within seconds, the other request gets 503 with
  ``Retry-After``, and both usage records say ``engine_unavailable``/503; ``/readyz`` says 503
  while the engine is down or restarting and 200 once the supervisor's restart serves again, a
  chat succeeds on the new process, the old one is reaped (no zombie), the log names its death
  and ``tandem_engine_restarts_total`` counts the restart (one kill for all of it: each engine
  restart costs 15-45 s of the suite);
* the inputs that used to crash the engine (``top_k`` = 2³¹, a token id beyond the vocabulary)
  are a 400, and the engine stays up: same process, no restart.

Measured times (kill → stream ended, kill → ready again) are printed (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.sockets import free_port
from tests.waiting import wait_until, wait_until_sync

pytestmark = pytest.mark.slow
ADMIN = "supervised-admin-token"
MODEL = "tandem-tiny"
STARTUP_TIMEOUT_S = 300.0
"""The engine's start-up, first or after a restart: 15-30 s on an idle 2-core machine."""
DEATH_NOTICE_TIMEOUT_S = 20.0
"""How long a client in flight may wait to hear that the engine died (the issue: "within a
second or two"; measured: well under a second)."""


@dataclass
class Served:
    """The running `tandem serve` and a tenant's key."""

    proc: subprocess.Popen[bytes]
    base_url: str
    engine_port: int
    tenant_id: str
    key: str
    log_path: Path

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN}"}

    def engine_pid(self) -> int:
        """The engine's main process: the child of `tandem serve` that runs SGLang's server."""
        pids = [
            pid
            for pid in _pgrep(f"sglang.launch_server.*--port {self.engine_port}")
            if _parent_of(pid) == self.proc.pid
        ]
        assert len(pids) == 1, pids
        return pids[0]

    def readyz(self) -> int | None:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            return httpx.get(f"{self.base_url}/readyz", timeout=5).status_code
        except httpx.HTTPError:
            return None

    def restarts(self) -> float:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "tandem_engine_restarts_total":
                    return sample.value
        raise AssertionError("no tandem_engine_restarts_total on /metrics")

    def chat(self, **fields: Any) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
        return httpx.post(
            f"{self.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )

    def records(self) -> list[dict[str, Any]]:
        """The tenant's usage records written so far, newest first."""
        resp = httpx.get(
            f"{self.base_url}/admin/v1/requests?tenant={self.tenant_id}&limit=100",
            headers=self.admin,
            timeout=10,
        )
        return list(resp.json()["data"])

    def records_when(self, count: int) -> list[dict[str, Any]]:
        """The tenant's usage records, newest first, once at least *count* are written."""

        def written() -> list[dict[str, Any]] | None:
            data = self.records()
            return data if len(data) >= count else None

        return wait_until_sync(written, 30, what=f"{count} usage records")


def _pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state


def is_reaped(pid: int) -> bool:
    """Gone for good: neither running nor a zombie waiting for its parent's wait()."""
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("supervised")
    gw_port, engine_port = free_port(), free_port()
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN=ADMIN,
        TANDEM_GATEWAY__PORT=str(gw_port),
        TANDEM_ENGINE__PORT=str(engine_port),
        TANDEM_DATABASE__URL=f"sqlite:///{tmp / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp / "cache"),
        TANDEM_ENGINE__LOG_FILE=str(tmp / "engine.log"),
        TANDEM_ENGINE__SKIP_PROFILE="true",
        TANDEM_ENGINE__RESTART_BACKOFF_S="0.5",
        TANDEM_USAGE__FLUSH_INTERVAL_S="0.1",
    )
    log_path = tmp / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"], env=env, stdout=log, stderr=log
        )
    base = f"http://127.0.0.1:{gw_port}"
    try:
        served = Served(proc, base, engine_port, "", "", log_path)
        wait_until_sync(
            lambda: served.readyz() == 200, STARTUP_TIMEOUT_S, what="ready", max_interval_s=1.0
        )
        tenant = httpx.post(
            f"{base}/admin/v1/tenants",
            headers=served.admin,
            json={"name": "witness", "tier": "rt", "slo": {"ttft_ms": 60000, "tpot_ms": 10000}},
        ).json()
        key = httpx.post(f"{base}/admin/v1/tenants/{tenant['id']}/keys", headers=served.admin)
        served.tenant_id, served.key = tenant["id"], key.json()["key"]
        yield served
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"\n--- tandem serve log (tail) ---\n{log_path.read_text()[-4000:]}")


def wait_ready_again(served: Served, killed_at: float) -> float:
    """Waits until /readyz says 200 again; seconds from *killed_at*."""
    wait_until_sync(
        lambda: served.readyz() == 200, STARTUP_TIMEOUT_S, what="ready again", max_interval_s=0.2
    )
    return time.monotonic() - killed_at


def test_crashing_inputs_are_refused_and_the_engine_stays_up(served: Served) -> None:
    pid = served.engine_pid()
    reply = served.chat(top_k=2**31, max_tokens=2)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "top_k", reply.text
    reply = httpx.post(
        f"{served.base_url}/v1/completions",
        json={"model": MODEL, "prompt": [1_000_000], "max_tokens": 2},
        headers={"Authorization": f"Bearer {served.key}"},
        timeout=60,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt[0]", reply.text
    reply = served.chat(max_tokens=3)
    assert reply.status_code == 200, reply.text
    assert served.engine_pid() == pid and served.restarts() == 0 and served.readyz() == 200


def test_a_killed_engine_ends_the_clients_in_flight_at_once_and_is_restarted(
    served: Served,
) -> None:
    known = len(served.records())
    restarts = served.restarts()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {served.key}"}
    ended: dict[str, float] = {}
    events: list[str] = []

    async def stream(first_token: asyncio.Event) -> int:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream(
                "POST",
                f"{served.base_url}/v1/chat/completions",
                json={**body, "stream": True},
                headers=headers,
            ) as resp,
        ):
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    events.append(line[len("data:") :].strip())
                    first_token.set()
            ended["stream"] = time.monotonic()
            return resp.status_code

    async def whole() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            resp = await client.post(
                f"{served.base_url}/v1/chat/completions", json=body, headers=headers
            )
            ended["whole"] = time.monotonic()
            return resp

    async def scenario() -> tuple[int, httpx.Response, float]:
        first_token = asyncio.Event()
        streaming = asyncio.create_task(stream(first_token))
        waiting = asyncio.create_task(whole())
        await asyncio.wait_for(first_token.wait(), 60)
        await wait_until(lambda: len(events) >= 5, 60, what="the stream under way")
        pid = served.engine_pid()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        status, reply = await asyncio.wait_for(
            asyncio.gather(streaming, waiting), DEATH_NOTICE_TIMEOUT_S
        )
        return status, reply, killed_at

    pid = served.engine_pid()
    status, reply, killed_at = asyncio.run(scenario())
    stream_s, whole_s = ended["stream"] - killed_at, ended["whole"] - killed_at
    print(f"\nengine SIGKILL -> stream ended {stream_s:.3f} s, 503 answered {whole_s:.3f} s")

    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    assert '"error"' in events[-2] and "engine_unavailable" in events[-2], events[-3:]
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["code"] == "engine_unavailable"
    assert int(reply.headers["Retry-After"]) >= 1
    newest = served.records_when(known + 2)[:2]
    assert sorted(r["stream"] for r in newest) == [False, True], newest
    for record in newest:
        assert (record["status"], record["http_status"]) == ("engine_unavailable", 503), record
        assert record["completion_tokens"] >= 1 or not record["stream"]

    # The restart takes seconds (the engine loads its model again): /readyz says so meanwhile.
    wait_until_sync(lambda: served.readyz() == 503, 30, what="/readyz 503 while the engine is down")
    body = httpx.get(f"{served.base_url}/readyz", timeout=5).json()
    assert body["checks"]["engine"] == "unavailable", body
    wait_until_sync(lambda: is_reaped(pid), 30, what="the dead engine reaped (no zombie)")

    recovered_s = wait_ready_again(served, killed_at)
    print(f"engine SIGKILL -> /readyz 200 again after {recovered_s:.1f} s")
    reply = served.chat(max_tokens=3)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
    assert served.engine_pid() != pid
    assert served.restarts() == restarts + 1
    assert f"engine pid {pid} exited: killed by SIGKILL (status -9)" in served.log_path.read_text()
