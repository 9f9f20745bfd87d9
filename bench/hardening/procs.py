"""The processes of a hardening run: the gateway (`tandem serve`, on CPU 0) in front of the fake
engine (CPU 1), and the load generator (this process, CPU 1 too).

The gateway is a real `tandem serve` — auth, quotas, the SLO admission (on the fake engine's
`/load` reports), the tier queues and the usage recorder all on — with `engine.kind: sim` and
`engine.launch: false`, so it connects to the fake engine instead of starting one. It gets one
RT tenant with an SLO contract and quotas (generous: they are checked on every request and never
refuse) and its key. Every process is started with `nice -n 15` (the machine is shared) and
stopped, also when the run fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from common.sockets import free_port

GATEWAY_CPU = 0
CLIENT_CPU = 1
ADMIN_TOKEN = "hardening-bench-admin"
MODEL = "tandem-tiny"
START_TIMEOUT_S = 90.0
QUOTA = {
    "requests_per_min": 10_000_000,
    "tokens_per_min": 10_000_000_000,
    "max_concurrent": 100_000,
    "monthly_tokens": 10**15,
}
"""Limits that are checked on every request and never reached."""
SLO = {"ttft_ms": 10_000, "tpot_ms": 2_000}


def pin_to(cpu: int) -> None:
    """Runs this process on *cpu* only (the load generator shares CPU 1 with the fake engine)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {cpu})


def _pinned(cpu: int, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), "nice", "-n", "15", *argv]


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} within {START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def fake_engine() -> Iterator[str]:
    """The fake engine on CPU 1; its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.hardening", "fake-engine", "--port", str(port)]
    proc = subprocess.Popen(_pinned(CLIENT_CPU, argv))
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, "the fake engine")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


@dataclass(frozen=True)
class Gateway:
    """A running gateway: its URL, its process id, the tenant key the load uses."""

    base_url: str
    pid: int
    key: str


@contextlib.contextmanager
def gateway(
    engine_url: str,
    *,
    database_url: str | None = None,
    cprofile_out: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Gateway]:
    """`tandem serve` on CPU 0 in front of *engine_url* (a fresh SQLite database unless
    *database_url*), with a tenant and key made; under cProfile when *cprofile_out* is given
    (the profile is written when it stops)."""
    engine_port = engine_url.rsplit(":", 1)[1]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tandem-hardening-") as tmp:
        environ = {
            **os.environ,
            "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN,
            "TANDEM_DATABASE__URL": database_url or f"sqlite:///{tmp}/tandem.db",
            "TANDEM_ENGINE__KIND": "sim",
            "TANDEM_ENGINE__LAUNCH": "false",
            "TANDEM_ENGINE__PORT": engine_port,
            "TANDEM_GATEWAY__PORT": str(port),
            **(env or {}),
        }
        python = [sys.executable]
        if cprofile_out is not None:
            python += ["-m", "cProfile", "-o", str(cprofile_out)]
        argv = _pinned(GATEWAY_CPU, [*python, "-m", "tandem", "serve"])
        log = open(Path(tmp) / "gateway.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_http(f"{base}/readyz", proc, "the gateway")
            yield Gateway(base, proc.pid, _tenant_key(base))
        except BaseException:
            log.flush()
            sys.stderr.write((Path(tmp) / "gateway.log").read_text()[-4000:])
            raise
        finally:
            _stop(proc)
            log.close()


def _tenant_key(base_url: str) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    body: dict[str, Any] = {"name": "load", "tier": "rt", "slo": SLO, "quota": QUOTA}
    tenant = requests.post(f"{base_url}/admin/v1/tenants", json=body, headers=admin, timeout=10)
    tenant.raise_for_status()
    key = requests.post(
        f"{base_url}/admin/v1/tenants/{tenant.json()['id']}/keys", headers=admin, timeout=10
    )
    key.raise_for_status()
    return str(key.json()["key"])


def rss_bytes(pid: int) -> int:
    """The resident set size of process *pid*, bytes (from /proc, not the gateway's /metrics)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """CPU time process *pid* has used so far (user + system), seconds (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
