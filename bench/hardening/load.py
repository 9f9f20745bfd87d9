"""An open-loop load generator: chat requests at a fixed rate, whatever the answers take.

Request i is sent at ``start + i / rate`` (a late generator sends at once and counts how late it
was: `late_ms`), each in its own task over one keep-alive connection pool, so a slow server makes
requests pile up instead of slowing the arrivals (no coordinated omission). Each request's
latency is from the moment it was sent to its last byte (`e2e_ms`) and to its first SSE event
(`ttft_ms`, streaming only).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

REQUEST_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Target:
    """Where the load goes: a chat-completions URL, its bearer token, the request's shape."""

    url: str
    token: str
    model: str
    stream: bool
    max_tokens: int = 16
    prompt: str = "Hello, how are you today?"

    def body(self) -> bytes:
        return json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens,
                "stream": self.stream,
            }
        ).encode()


@dataclass
class Outcome:
    """What the generator saw of one run."""

    rate: float
    duration_s: float
    stream: bool
    e2e_ms: list[float] = field(default_factory=list)
    """Latency of every successful request, ms."""
    ttft_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    """How late the generator sent each request, ms (it kept up when p99 is ~0)."""
    statuses: dict[str, int] = field(default_factory=dict)
    """Answers by status (``timeout``, ``connection`` for requests that got none)."""
    sent: int = 0
    wall_s: float = 0.0
    """From the first send to the last answer, seconds."""

    @property
    def ok(self) -> int:
        return self.statuses.get("200", 0)

    @property
    def errors(self) -> int:
        return self.sent - self.ok

    def percentile(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    def row(self) -> dict[str, Any]:
        """The run's figures, rounded."""
        e2e, ttft = self.e2e_ms, self.ttft_ms
        return {
            "stream": self.stream,
            "rate": self.rate,
            "sent": self.sent,
            "ok": self.ok,
            "errors": self.errors,
            "statuses": dict(sorted(self.statuses.items())),
            "achieved_rps": round(self.ok / self.duration_s, 1),
            # goodput: an answer seconds late is no answer to an interactive client
            "ok_within_1s": sum(1 for ms in e2e if ms <= 1000.0),
            "ok_within_10s": sum(1 for ms in e2e if ms <= 10_000.0),
            "e2e_p50_ms": round(self.percentile(e2e, 50), 2),
            "e2e_p90_ms": round(self.percentile(e2e, 90), 2),
            "e2e_p99_ms": round(self.percentile(e2e, 99), 2),
            "e2e_max_ms": round(max(e2e), 2) if e2e else None,
            "ttft_p50_ms": round(self.percentile(ttft, 50), 2) if ttft else None,
            "ttft_p99_ms": round(self.percentile(ttft, 99), 2) if ttft else None,
            "late_p99_ms": round(self.percentile(self.late_ms, 99), 2),
        }


async def _one(session: aiohttp.ClientSession, target: Target, body: bytes, out: Outcome) -> None:
    headers = {"Authorization": f"Bearer {target.token}", "Content-Type": "application/json"}
    sent = time.perf_counter()
    first: float | None = None
    try:
        async with session.post(target.url, data=body, headers=headers) as resp:
            if target.stream and resp.status == 200:
                async for line in resp.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter()
            else:
                await resp.read()
            status = str(resp.status)
    except TimeoutError:
        status = "timeout"
    except aiohttp.ClientError:
        status = "connection"
    done = time.perf_counter()
    out.statuses[status] = out.statuses.get(status, 0) + 1
    if status == "200":
        out.e2e_ms.append((done - sent) * 1000.0)
        if first is not None:
            out.ttft_ms.append((first - sent) * 1000.0)


async def run_open_loop(target: Target, rate: float, duration_s: float) -> Outcome:
    """Sends ``rate * duration_s`` requests at *rate* per second and waits for every answer."""
    out = Outcome(rate=rate, duration_s=duration_s, stream=target.stream)
    body = target.body()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: list[asyncio.Task[None]] = []
        count = int(rate * duration_s)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(count):
            due = start + i / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                out.late_ms.append(-delay * 1000.0)
            if delay > 0:
                out.late_ms.append(0.0)
            tasks.append(asyncio.create_task(_one(session, target, body, out)))
            out.sent += 1
        await asyncio.gather(*tasks)
        out.wall_s = loop.time() - start
    return out


async def warm_up(target: Target, requests: int = 200, rate: float = 200.0) -> None:
    """A short run first: connections opened, caches and lazy imports warm."""
    await run_open_loop(target, rate, requests / rate)
