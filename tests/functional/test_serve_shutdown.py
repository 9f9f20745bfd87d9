"""`tandem serve` stopped while a client streams (gateway/shutdown.py), as a process manager
stops it: on SIGTERM the gateway stops listening but the stream goes on; a second SIGTERM ends
it at once with an error event and `[DONE]`, and serve exits cleanly. In front of the simulator
(`engine.kind: sim`, which streams at an H100's pace), so no SGLang start-up."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx

from common.sockets import free_port
from tests.functional.serve_process import new_rt_key, serving
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
    events: list[str] = []
    stream_error: list[BaseException] = []

    def stream(base: str, key: str) -> None:
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

    with serving(env, tmp_path / "serve.log", ready_timeout_s=120) as served:
        proc, base, log_path = served.proc, served.base_url, served.log_path
        key = new_rt_key(base, ADMIN, "streamer")
        client = threading.Thread(target=stream, args=(base, key))
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
    output = log_path.read_text()
    assert proc.returncode == 0, output
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "gateway_shutting_down", error
    assert "ending the 1 requests still in flight" in output, output
