"""`tandem batch create --watch` while its gateway restarts, as a deploy does: `tandem serve` is
stopped mid-batch and started again on the same port and database; the watch says it waits for
the gateway, carries on when it answers, and ends with the batch completed, every line once. In
front of the simulator (`engine.kind: sim`), so no SGLang start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from common.sockets import free_port
from tests.functional.serve_process import serving
from tests.gateway.test_batches import chat_line, jsonl
from tests.waiting import wait_until_sync

ADMIN = "batch-watch-restart-admin-token"
LINES = 12


def test_a_watch_waits_out_a_gateway_restart_and_sees_the_batch_complete(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        TANDEM_ADMIN_TOKEN=ADMIN,
        TANDEM_GATEWAY__PORT=str(free_port()),
        TANDEM_ENGINE__PORT=str(free_port()),
        TANDEM_ENGINE__KIND="sim",
        TANDEM_DATABASE__URL=f"sqlite:///{tmp_path / 'serve.db'}",
        TANDEM_MODEL__CACHE_DIR=str(tmp_path / "cache"),
        TANDEM_BATCH__MAX_INFLIGHT="2",  # the batch takes a while: the restart falls inside it
    )
    source = tmp_path / "lines.jsonl"
    lines = [
        chat_line(f"line-{i:02d}", f"story {i}", max_tokens=300, ignore_eos=True)
        for i in range(LINES)
    ]
    source.write_bytes(jsonl(lines))
    watch_log = tmp_path / "watch.log"
    watch: subprocess.Popen[str] | None = None
    try:
        with serving(env, tmp_path / "serve-1.log", ready_timeout_s=120) as first:
            key = new_be_key(first.base_url)
            with open(watch_log, "w") as out:
                command = ["batch", "create", str(source), "--watch", "--url", first.base_url]
                watch = subprocess.Popen(
                    [sys.executable, "-m", "gateway", *command, "--api-key", key],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=out,
                    text=True,
                )
            wait_until_sync(
                lambda: f"/{LINES} lines" in watch_log.read_text(), 60, what="the watch drawing"
            )
            first.proc.send_signal(signal.SIGTERM)  # the lines in flight finish, then it exits
            first.proc.wait(timeout=60)
        wait_until_sync(
            lambda: "waiting for the gateway" in watch_log.read_text(),
            60,
            what="the watch waiting for the gateway",
        )
        assert watch.poll() is None, watch_log.read_text()
        with serving(env, tmp_path / "serve-2.log", ready_timeout_s=120):
            stdout, _ = watch.communicate(timeout=240)
    finally:
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait()
    progress = watch_log.read_text()
    assert watch.returncode == 0, progress
    batch = json.loads(stdout)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert "Connection refused" in progress  # what it waited out, said on its line
    assert f"{LINES}/{LINES} lines" in progress.rsplit("\r", 1)[-1]


def new_be_key(base_url: str) -> str:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    tenant = httpx.post(
        f"{base_url}/admin/v1/tenants", headers=admin, json={"name": "watcher", "tier": "be"}
    ).json()
    key = httpx.post(f"{base_url}/admin/v1/tenants/{tenant['id']}/keys", headers=admin).json()
    return str(key["key"])
