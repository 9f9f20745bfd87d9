"""`tandem serve` as the README runs it: migrations, the engine, the gateway; Ctrl-C stops both
and leaves no engine process behind. It runs with --skip-profile (measuring is
test_serve_profile.py's subject), so it also checks what that flag does with no stored profile:
the bundled profile, a warning, and the engine saying the profile does not match."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.config import EngineConfig
from common.sockets import free_port
from tests.functional.serve_process import new_rt_key, serving
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.slow
ADMIN = "serve-test-admin-token"


def engine_pids(port: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"sglang.launch_server.*--port {port}"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def assert_engine_needs_its_key(engine_port: int, gateway_url: str) -> None:
    """The engine's port refuses what does not come through the gateway (issue 17: anyone on
    the host bypassed keys, quotas and usage records), while the gateway's own polls of it
    succeed; its key is not on its command line, which every user of the host can read."""
    engine = f"http://127.0.0.1:{engine_port}"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{engine}/generate", json=body, timeout=60).status_code == 401
    assert httpx.get(f"{engine}/v1/models", timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.post(f"{engine}/generate", json=body, headers=wrong).status_code == 401
    assert httpx.get(f"{engine}/health", timeout=60).status_code == 200  # probes stay open
    for pid in engine_pids(engine_port):
        assert b"--api-key" not in Path(f"/proc/{pid}/cmdline").read_bytes()

    def engine_polled() -> bool:  # the gateway's load sampler sends the key: it sees the engine
        text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
        return "tandem_engine_running_requests" in text

    wait_until_sync(engine_polled, 60, what="the gateway's sampler reading the engine's load")


def run_serve_and_chat(
    tmp_path: Path, *, check_engine: bool = False, **env_overrides: str
) -> tuple[str, dict[str, Any]]:
    """Starts `tandem serve`, chats through it, stops it with SIGINT; asserts a clean exit.
    Returns its output and, with *check_engine*, the engine's /stats read while it served;
    *check_engine* also checks that the engine refuses requests that bypass the gateway."""
    gw_port = free_port()
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN=ADMIN,
        TANDEM_GATEWAY__PORT=str(gw_port),
        TANDEM_ENGINE__PORT=str(free_port()),
        TANDEM_DATABASE__URL=f"sqlite:///{tmp_path / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp_path / "cache"),
        TANDEM_ENGINE__LOG_FILE=str(tmp_path / "engine.log"),
        # measuring the engine's profile is test_serve_profile's subject; here it only costs
        TANDEM_ENGINE__SKIP_PROFILE="true",
    )
    env.update(env_overrides)
    stats: dict[str, Any] = {}
    with serving(env, tmp_path / "serve.log") as served:
        base = served.base_url
        key = new_rt_key(base, ADMIN, "smoke")
        reply = openai.OpenAI(base_url=f"{base}/v1", api_key=key).chat.completions.create(
            model="tandem-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        if check_engine:
            engine_port = int(env["TANDEM_ENGINE__PORT"])
            assert_engine_needs_its_key(engine_port, base)
            socket_path = EngineConfig(port=engine_port).control_socket_path
            transport = httpx.HTTPTransport(uds=str(socket_path))
            with httpx.Client(transport=transport, timeout=10) as control:
                stats = control.get("http://engine/stats").json()
    output = served.output()
    assert served.proc.returncode == 0, output
    return output, stats


def test_serve_answers_then_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    output, stats = run_serve_and_chat(tmp_path, check_engine=True, TANDEM_ENGINE__PORT=str(port))
    wait_until_sync(lambda: engine_pids(port) == [], 30, what="every engine process gone")
    # nor its control socket (its scheduler is killed, so `tandem serve` removes the file)
    assert not Path(EngineConfig(port=port).control_socket_path).exists()
    # --skip-profile with nothing stored: never measures, says which profile it plans with
    # instead, and the engine says that profile is not its own
    assert "measuring one" not in output, output
    assert "using the bundled cpu-tiny" in output, output
    assert "latency profile 'cpu-tiny' does not match the served engine" in output, output
    assert stats["profile"] == "cpu-tiny" and stats["profile_matches"] is False, stats


def test_serve_fronts_the_simulator(tmp_path: Path) -> None:
    """`engine.kind: sim`: the gateway cannot tell the simulator from SGLang."""
    run_serve_and_chat(tmp_path, TANDEM_ENGINE__KIND="sim")
