"""Which of tandem's source files one chat request runs through in the gateway process.

    python -m bench.studies.request_path [--stream]

Starts the simulator's engine server and the gateway in this process (ports chosen by the OS),
creates an RT tenant and a key through the admin API, sends one warm-up request, then records
every function call during a second chat request (the usage record's write included) and prints
the files of tandem's own code they ran in, by layer. The simulator's own files are left out:
they stand for the engine process. A measure of how many rooms a reader walks through to follow
one request (issue 14).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from backend.launch.tiny_model import ensure_tiny_model
from backend.policy.latency import LatencyModel
from backend.policy.registry import make_policy
from backend.sim.config import SimConfig
from backend.sim.server import create_sim_app
from common.config import load_config
from gateway.app import create_app
from gateway.store.migrate import upgrade_async

REPO = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "request-path-admin"
LAYERS = ("common", "gateway")
"""Folders counted: the gateway's own code and what it shares with the engine. (The policy code
that runs in this process is the simulator's, which stands for the engine.)"""


def _collector(seen: set[str]) -> Callable[[FrameType, str, Any], None]:
    root = str(REPO) + os.sep

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root):
                seen.add(name[len(root) :])

    return profile


async def measure(stream: bool) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ensure_tiny_model(Path(tmp) / "model")
        latency = LatencyModel([0.002, 0.004, 0.0002, 0.0, 0.0, 0.0, 0.0, 0.0])
        sim = create_sim_app(
            make_policy("fcfs", latency),
            latency,
            SimConfig(kv_capacity_tokens=200_000),
            time_scale=1.0,
        )
        sim_server = TestServer(sim, host="127.0.0.1", port=0)
        await sim_server.start_server()
        config = load_config(
            environ={
                "TANDEM_DATABASE__URL": f"sqlite:///{tmp}/tandem.db",
                "TANDEM_ENGINE__PORT": str(sim_server.port),
                "TANDEM_ENGINE__LAUNCH": "false",
                "TANDEM_USAGE__FLUSH_INTERVAL_S": "0.05",
            }
        )
        await upgrade_async(config.database.url)
        gateway = TestServer(create_app(config, ADMIN_TOKEN, model_dir), host="127.0.0.1", port=0)
        await gateway.start_server()
        base = str(gateway.make_url("")).rstrip("/")
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with aiohttp.ClientSession() as session:
            tenant = {"name": "chat", "tier": "rt", "slo": {"ttft_ms": 5000, "tpot_ms": 1000}}
            async with session.post(f"{base}/admin/v1/tenants", json=tenant, headers=admin) as r:
                tenant_id = (await r.json())["id"]
            async with session.post(
                f"{base}/admin/v1/tenants/{tenant_id}/keys", headers=admin
            ) as r:
                key = (await r.json())["key"]
            body = {
                "model": config.model.name,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8,
                "stream": stream,
            }
            headers = {"Authorization": f"Bearer {key}"}

            async def one_request() -> None:
                url = f"{base}/v1/chat/completions"
                async with session.post(url, json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                await _wait_for_records(Path(tmp) / "tandem.db")

            await one_request()  # warm-up: caches, lazy imports, the first usage flush
            seen: set[str] = set()
            profile = _collector(seen)
            threading.setprofile(profile)
            sys.setprofile(profile)
            try:
                await one_request()
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
        await gateway.close()
        await sim_server.close()
    return sorted(f for f in seen if f.startswith(LAYERS) and f.endswith(".py"))


_records_seen = [0]


async def _wait_for_records(db: Path) -> None:
    """Polls the SQLite file (not the admin API, whose code would count) until the request's
    usage record is written."""
    _records_seen[0] += 1
    for _ in range(400):
        with sqlite3.connect(db) as conn:
            (count,) = conn.execute("SELECT count(*) FROM usage_records").fetchone()
        if count >= _records_seen[0]:
            return
        await asyncio.sleep(0.02)
    raise RuntimeError("the usage record never appeared")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.request_path")
    parser.add_argument("--stream", action="store_true", help="a streaming request")
    args = parser.parse_args(argv)
    files = asyncio.run(measure(args.stream))
    for name in files:
        print(name)
    print(f"{len(files)} files of tandem's code ran for one chat request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
