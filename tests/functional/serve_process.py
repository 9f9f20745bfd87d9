"""`tandem serve` as a child process of a functional test: started with the test's environment
(its `TANDEM_*` settings), its output in a file (never a pipe, which blocks serve once full),
waited for until `/readyz` answers 200, and always stopped — with SIGINT, as Ctrl-C does, and
killed if it does not exit within a minute — also when the test fails."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.waiting import wait_until_sync

STOP_TIMEOUT_S = 60.0
"""How long serve may take to exit after SIGINT before the test kills it, seconds."""


@dataclass(frozen=True)
class ServeProcess:
    """A running `tandem serve`."""

    proc: subprocess.Popen[str]
    base_url: str
    """The gateway's ``http://127.0.0.1:<port>``."""
    log_path: Path
    """Serve's stdout and stderr."""

    def output(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def serving(
    env: dict[str, str],
    log_path: Path,
    *args: str,
    ready_timeout_s: float = 240.0,
) -> Iterator[ServeProcess]:
    """`tandem serve *args` with *env* (which sets `TANDEM_GATEWAY__PORT`), ready; stopped on
    exit if it still runs (SIGINT, then SIGKILL after `STOP_TIMEOUT_S`, which fails the test)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    served = ServeProcess(proc, f"http://127.0.0.1:{env['TANDEM_GATEWAY__PORT']}", log_path)

    def ready() -> bool:
        assert proc.poll() is None, served.output()
        try:
            return httpx.get(f"{served.base_url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until_sync(ready, ready_timeout_s, what="the gateway ready", max_interval_s=1.0)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise


def new_rt_key(base_url: str, admin_token: str, name: str) -> str:
    """A new RT tenant *name* (TTFT 5 s, TPOT 1 s: any CPU engine meets them) and its key."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    tenant = httpx.post(
        f"{base_url}/admin/v1/tenants",
        headers=admin,
        json={"name": name, "tier": "rt", "slo": {"ttft_ms": 5000, "tpot_ms": 1000}},
    ).json()
    key = httpx.post(f"{base_url}/admin/v1/tenants/{tenant['id']}/keys", headers=admin).json()
    return str(key["key"])
