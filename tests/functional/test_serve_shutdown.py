"""`tandem serve` stopped while a client streams (gateway/shutdown.py), as a process manager
stops it: on SIGTERM the gateway stops listening but the stream goes on; a second SIGTERM ends
it at once with an error event and `[DONE]`, and serve exits cleanly. In front of the simulator
(`engine.kind: sim`, which streams at an H100's pace), so no SGLang start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from common.sockets import free_port
from tests.waiting import wait_until_sync

ADMIN = "serve-shutdown-test-admin-token"


def test_sigterm_lets_a_stream_go_on_and_a_second_one_ends_it_with_an_error_event(
    tmp_path: Path,
) -> None:
    gw_port = free_port()
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN=ADMIN,
        TANDEM_GATEWAY__PORT=str(gw_port),
        TANDEM_ENGINE__PORT=str(free_port()),
        TANDEM_ENGINE__KIND="sim",
        TANDEM_DATABASE__URL=f"sqlite:///{tmp_path / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp_path / "cache"),
    )
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"], env=env, stdout=log, stderr=log
        )
    base = f"http://127.0.0.1:{gw_port}"
    events: list[str] = []
    stream_error: list[BaseException] = []

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stream(key: str) -> None:
        body = {
            "model": "tandem-tiny",
            "messages": [{"role": "user", "content": "tell me everything"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST",
                f"{base}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        events.append(line[len("data:") :].strip())
        except BaseException as exc:  # the test's assertions below say what went wrong
            stream_error.append(exc)

    try:
        wait_until_sync(ready, 120, what="the gateway ready", max_interval_s=0.5)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        tenant = httpx.post(
            f"{base}/admin/v1/tenants",
            headers=admin,
            json={"name": "streamer", "tier": "rt", "slo": {"ttft_ms": 5000, "tpot_ms": 1000}},
        ).json()
        key = httpx.post(f"{base}/admin/v1/tenants/{tenant['id']}/keys", headers=admin).json()
        client = threading.Thread(target=stream, args=(key["key"],))
        client.start()
        wait_until_sync(lambda: len(events) >= 5, 60, what="the stream under way")

        proc.send_signal(signal.SIGTERM)
        wait_until_sync(
            lambda: "waiting up to 60 s" in log_path.read_text(), 30, what="the drain begun"
        )
        seen = len(events)
        wait_until_sync(lambda: len(events) >= seen + 20, 60, what="the stream going on")
        assert proc.poll() is None and client.is_alive()
        try:  # no longer listening: a new client goes elsewhere
            refused = httpx.get(f"{base}/readyz", timeout=2).status_code != 200
        except httpx.HTTPError:
            refused = True
        assert refused

        proc.send_signal(signal.SIGTERM)  # the second: what is in flight ends now
        client.join(timeout=30)
        assert not client.is_alive() and not stream_error, stream_error
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    assert proc.returncode == 0, output
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "gateway_shutting_down", error
    assert "ending the 1 requests still in flight" in output, output
