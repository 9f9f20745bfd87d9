"""A batch survives its gateway being killed: `tandem serve` (a real process, in front of the
session's CPU engine) is SIGKILLed in the middle of a batch and started again on the same
database; the batch completes, and its output file has every custom_id exactly once."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from common.sockets import free_port
from tests.functional.engine_fixtures import EngineServer
from tests.functional.mid_batch import freeze_with_lines_running
from tests.waiting import wait_until_sync

pytestmark = pytest.mark.slow
ADMIN_TOKEN = "restart-admin-token"
LINES = 30


class GatewayProcess:
    """`python -m gateway serve` with the engine already running elsewhere."""

    def __init__(self, engine: EngineServer, db: Path, log: Path) -> None:
        self.port = free_port()
        self.env = {
            **os.environ,
            "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN,
            "TANDEM_DATABASE__URL": f"sqlite:///{db}",
            "TANDEM_ENGINE__LAUNCH": "false",
            "TANDEM_ENGINE__PORT": str(engine.port),
            "TANDEM_MODEL__PATH": str(engine.model_path),
            "TANDEM_GATEWAY__PORT": str(self.port),
            "TANDEM_BATCH__MAX_INFLIGHT": "3",
            "TANDEM_BATCH__POLL_INTERVAL_S": "0.2",
        }
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve"],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc = self.proc

        def healthy() -> bool:
            assert proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_until_sync(healthy, 120, what=lambda: f"gateway start: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, no graceful shutdown."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def admin(self, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}/admin/v1{path}",
            data=json.dumps(body or {}).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as resp:
            return json.loads(resp.read())


@pytest.fixture
def gateway_process(engine_server: EngineServer, tmp_path: Path) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(engine_server, tmp_path / "tandem.db", tmp_path / "gateway.log")
    yield gw
    gw.stop()


def test_killed_gateway_resumes_the_batch_without_losing_or_duplicating_a_line(
    gateway_process: GatewayProcess, tmp_path: Path
) -> None:
    gw = gateway_process
    gw.start()
    tenant = gw.admin("/tenants", {"name": "restart-be", "tier": "be"})
    key = gw.admin(f"/tenants/{tenant['id']}/keys")["key"]
    lines = [
        {
            "custom_id": f"line-{i:02d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tandem-tiny",
                "max_tokens": 48,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Tell story number {i}."}],
            },
        }
        for i in range(LINES)
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    file_id = api.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch").id
    batch_id = api.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id

    def line_counts() -> tuple[int, int] | None:
        """(lines succeeded, lines running) as committed in SQL, or None while the gateway holds
        SQLite's write lock: frozen in the middle of a commit, it may have written the commit to
        the WAL without publishing it yet, and the restart's WAL recovery would then see the line
        finished that this read sees running (a CI run read 3 running, 2 ran again)."""
        db = sqlite3.connect(tmp_path / "tandem.db", timeout=0, isolation_level=None)
        try:
            try:
                db.execute("BEGIN IMMEDIATE")  # fails at once if a write transaction is open
            except sqlite3.OperationalError:
                return None
            rows = db.execute(
                "SELECT status, count(*) FROM batch_items WHERE batch_id = ? GROUP BY status",
                (batch_id,),
            ).fetchall()
            db.execute("ROLLBACK")
        finally:
            db.close()
        counts = dict(rows)
        return counts.get("succeeded", 0), counts.get("running", 0)

    assert gw.proc is not None
    in_flight = freeze_with_lines_running(gw.proc, line_counts, min_done=4, total=LINES)
    gw.kill()

    gw.start()  # same database, new process
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)

    def finished() -> Any:
        batch = api.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    batch = wait_until_sync(finished, 600, what="the batch finished after the restart")
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
    assert batch.error_file_id is None and batch.output_file_id is not None
    out = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    ids = [line["custom_id"] for line in out]
    assert sorted(ids) == [line["custom_id"] for line in lines]  # each exactly once
    assert all(line["response"]["status_code"] == 200 for line in out)
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 48 for line in out)

    db = sqlite3.connect(tmp_path / "tandem.db")
    rerun = db.execute("SELECT count(*) FROM batch_items WHERE attempts > 1").fetchone()[0]
    db.close()
    assert rerun == in_flight  # the lines cut off by the kill ran again after the restart
