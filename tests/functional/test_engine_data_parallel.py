"""SGLang's own data parallelism behind the gateway (issue 18), on a real CPU engine: `tandem
serve` with ``engine.extra_args: [--dp-size, "2"]`` launches one patched SGLang engine whose two
DP ranks each run tandem's policy, and the gateway places on each rank as on a replica.

What an operator sees:

* the engine starts (before: SGLang's DP controller loaded the plugin, took the control socket
  DP rank 0 must serve, and rank 0 refused to start; and on a one-NUMA-node CPU host SGLang
  refuses two ranks unless their cores are given, which the launcher now does);
* `/readyz`, `/metrics` and the dashboard list each rank (``<url>#dp0``, ``<url>#dp1``), each with
  its own live state read from its own control socket;
* requests run on the rank the gateway chose (SGLang's ``routed_dp_rank``): with the
  round-robin router, both ranks run iterations for the chats sent;
* one rank's scheduler SIGKILLed: the engine is restarted at once (its control socket refuses
  connections) and the streams in flight end with an error event;
* stopping `tandem serve` leaves neither rank's control socket behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.sockets import free_port
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.slow
ADMIN = "dp-admin-token"
ENGINE_KEY = "dp-test-engine-key"
MODEL = "tandem-tiny"
STARTUP_TIMEOUT_S = 400.0
"""One engine with two DP ranks on a busy 2-core machine (about 30 s idle)."""


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    base_url: str
    engine_url: str
    socket: Path
    log_path: Path
    key: str = ""

    @property
    def ranks(self) -> list[str]:
        return [f"{self.engine_url}#dp0", f"{self.engine_url}#dp1"]

    def readyz(self) -> httpx.Response:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        return httpx.get(f"{self.base_url}/readyz", timeout=10)

    def iterations(self) -> dict[str, float]:
        """Each rank's iterations at its newest live-state report, by rank name."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {
            s.labels["engine"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tandem_engine_load_iteration"
        }

    def chat(self, content: str) -> httpx.Response:
        return httpx.post(
            f"{self.base_url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 8,
            },
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=120,
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("dp")
    gw_port, engine_port = free_port(), free_port()
    socket_path = tmp / "engine.sock"
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_CPU_OMP_THREADS_BIND"}
    env.update(
        TANDEM_ADMIN_TOKEN=ADMIN,
        TANDEM_GATEWAY__PORT=str(gw_port),
        TANDEM_GATEWAY__ROUTER="round-robin",  # the assertion on where chats ran needs turns
        TANDEM_ENGINE__PORT=str(engine_port),
        TANDEM_ENGINE__EXTRA_ARGS="[--dp-size, '2']",
        TANDEM_ENGINE__API_KEY=ENGINE_KEY,
        TANDEM_ENGINE__CONTROL_SOCKET=str(socket_path),
        TANDEM_ENGINE__MAX_RUNNING_REQUESTS="16",
        TANDEM_DATABASE__URL=f"sqlite:///{tmp / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp / "cache"),
        TANDEM_ENGINE__LOG_FILE=str(tmp / "engine.log"),
        TANDEM_ENGINE__SKIP_PROFILE="true",
    )
    log_path = tmp / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"], env=env, stdout=log, stderr=log
        )
    out = Served(
        proc,
        f"http://127.0.0.1:{gw_port}",
        f"http://127.0.0.1:{engine_port}",
        socket_path,
        log_path,
    )
    try:

        def ready() -> bool:
            try:
                return out.readyz().status_code == 200
            except httpx.HTTPError:
                return False

        wait_until_sync(ready, STARTUP_TIMEOUT_S, what="the DP engine ready", max_interval_s=1.0)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        tenant = httpx.post(
            f"{out.base_url}/admin/v1/tenants",
            headers=admin,
            json={"name": "dp-rt", "tier": "rt", "slo": {"ttft_ms": 60000, "tpot_ms": 10000}},
            timeout=30,
        ).json()
        out.key = httpx.post(
            f"{out.base_url}/admin/v1/tenants/{tenant['id']}/keys", headers=admin, timeout=30
        ).json()["key"]
        yield out
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"\n--- tandem serve log (tail) ---\n{log_path.read_text()[-4000:]}")
        print(f"--- engine log (tail) ---\n{(tmp / 'engine.log').read_text()[-3000:]}")


def test_each_dp_rank_is_a_replica_with_its_own_live_state(served: Served) -> None:
    body = served.readyz().json()
    assert [e["name"] for e in body["engines"]] == served.ranks
    assert all(e["serving"] for e in body["engines"]), body
    # each rank serves its own control endpoint, and its live state reaches the gateway
    assert served.socket.exists() and Path(f"{served.socket}.dp1").exists()
    wait_until_sync(
        lambda: set(served.iterations()) == set(served.ranks),
        30,
        what="both ranks' live state at the gateway",
    )
    dashboard = httpx.get(
        f"{served.base_url}/admin/v1/dashboard/data?hours=1",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    ).json()
    assert [e["name"] for e in dashboard["engines"]] == served.ranks


def test_requests_run_on_the_rank_the_gateway_chose(served: Served) -> None:
    before = served.iterations()
    for i in range(6):  # round-robin: three on each rank
        response = served.chat(f"question {i}: what is {i} + {i}?")
        assert response.status_code == 200, response.text
    # an idle rank runs no iterations: each one that ran more ran some of the chats
    wait_until_sync(
        lambda: all(served.iterations()[r] > before.get(r, 0.0) for r in served.ranks),
        30,
        what="both ranks' iterations to advance",
    )


def _scheduler_pid(rank: int) -> int:
    out = subprocess.run(
        ["pgrep", "-f", f"sglang::scheduler_DP{rank}"], capture_output=True, text=True
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, pids  # one engine with DP ranks runs on this machine: this test's
    return pids[0]


def test_a_dead_dp_ranks_scheduler_restarts_the_engine(served: Served) -> None:
    """SIGKILL one DP rank's scheduler process (as the OOM killer would: it holds the model and
    the KV pool): SGLang's main process runs on without noticing, and its /health took three
    25 s probes to give up. The supervisor sees the rank's control socket refuse connections
    within a second, restarts the engine, and both ranks serve again; the streams in flight end
    with an error event, not a hang."""
    before = _scheduler_pid(1)
    events: list[list[str]] = [[], []]
    ended: list[str | None] = [None, None]  # how a stream ended, once it has

    def stream(i: int) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"tell a long story {i}"}],
            "max_tokens": 4000,
            "ignore_eos": True,  # random weights may end a stream early otherwise
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{served.base_url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {served.key}"},
            timeout=120,
        ) as response:
            if response.status_code != 200:
                ended[i] = f"HTTP {response.status_code}: {response.read()[:300]!r}"
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[len("data: ") :])
        ended[i] = f"ended after {len(events[i])} events: {events[i][-3:]}"

    def both_flowing() -> bool:
        for i in (0, 1):  # a stream that ended before it flowed says why, at once
            if ended[i] is not None and len(events[i]) < 3:
                raise AssertionError(f"stream {i} {ended[i]}")
        return all(len(e) >= 3 for e in events)

    threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]  # one per rank
    for thread in threads:
        thread.start()
    wait_until_sync(both_flowing, 60, what=lambda: f"both streams flowing ({ended})")
    killed_at = time.monotonic()
    os.kill(before, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=60)
    ended_s = time.monotonic() - killed_at
    assert not any(thread.is_alive() for thread in threads)
    for lines in events:
        assert lines[-1] == "[DONE]"
        assert any('"error"' in line for line in lines[-3:]), lines[-3:]
    print(f"streams ended {ended_s:.2f} s after the scheduler's SIGKILL")

    def serving_again() -> bool:
        try:
            return served.readyz().status_code == 200 and _scheduler_pid(1) != before
        except (httpx.HTTPError, AssertionError):
            return False

    wait_until_sync(serving_again, STARTUP_TIMEOUT_S, what="the engine restarted", max_interval_s=1)
    log = served.log_path.read_text()
    assert "lost the scheduler of its DP rank 1" in log
    wait_until_sync(
        lambda: served.chat("after the restart").status_code == 200, 60, what="a chat served"
    )


def test_stopping_leaves_no_control_socket_behind(served: Served) -> None:
    # last in the module: stops the server the fixture started (its finalizer then finds it
    # stopped)
    served.proc.send_signal(signal.SIGINT)
    served.proc.wait(timeout=90)
    assert served.proc.returncode == 0, served.log_path.read_text()[-3000:]
    assert not served.socket.exists()
    assert not Path(f"{served.socket}.dp1").exists()
