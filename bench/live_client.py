"""The live bench's client: tenants through the admin API, the workload replayed on the wall
clock through the OpenAI completions API, one `RequestRecord` per request (bench/live.py).

Every request is streamed with exact token-id prompts, greedy decoding and ``ignore_eos``, and
with ``continuous_usage_stats``: the gateway sends an event for every token step with the running
usage, and the client stamps each token when the event that counts it arrives, which gives TTFT,
TBT and the token times the simulator's metrics code expects (stamping text instead would time a
token whose bytes end mid-character when its character is finished, seconds later with the tiny
model's random tokens).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import zlib
from array import array
from typing import Any

import aiohttp

from backend.sim.records import Admission, RequestRecord
from bench.workloads.base import RequestSpec, SpecSource

DOWNGRADED_HEADER = "X-Tandem-Downgraded"
"""The gateway's response header on an RT request it ran as BE (docs/API.md)."""
DRAIN_TIMEOUT_S = 240.0
"""How long after the arrival window the replay waits for requests still running."""


class RequestFailed(RuntimeError):
    """The gateway answered a request with an error other than an SLO refusal."""


class TenantKeys:
    """API keys made through the admin API: per named tenant of the workload (a request's
    `tenant_id`: W6's tenants, each with its tier, SLO and fair-share weight), else per SLO
    class (RT) and one for BE."""

    def __init__(self, base_url: str, admin_token: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {admin_token}"}
        self.session = session
        self._keys: dict[tuple[str, str, float | None, float | None], str] = {}

    async def key_for(self, spec: RequestSpec) -> str:
        rt = spec.tier == "rt"
        slo = (
            spec.tenant_id,
            spec.tier,
            spec.ttft_target_s if rt else None,
            spec.tpot_target_s if rt else None,
        )
        key = self._keys.get(slo)
        if key is None:
            key = self._keys[slo] = await self._new_tenant(spec)
        return key

    async def _new_tenant(self, spec: RequestSpec) -> str:
        label = spec.tenant_id or f"{spec.tier}-{len(self._keys)}"
        name = f"{label}-{secrets.token_hex(3)}"
        slo: dict[str, Any] = {}
        if spec.tier == "rt":
            slo = {
                "ttft_ms": round(1000 * (spec.ttft_target_s or 1.0), 3),
                "tpot_ms": round(1000 * (spec.tpot_target_s or 1.0), 3),
            }
        if spec.tenant_id:
            slo["weight"] = spec.tenant_weight
        return await create_tenant_key(
            self.session, self.base_url, self.headers, name, spec.tier, slo
        )


async def create_tenant_key(
    session: aiohttp.ClientSession,
    base_url: str,
    admin_headers: dict[str, str],
    name: str,
    tier: str,
    slo: dict[str, Any],
) -> str:
    """A new tenant made through the gateway's admin API, and a key for it; the key.
    RuntimeError naming the tenant when the gateway refuses either."""
    admin = f"{base_url}/admin/v1"
    body = {"name": name, "tier": tier, "slo": slo}
    async with session.post(f"{admin}/tenants", headers=admin_headers, json=body) as resp:
        tenant = await resp.json()
        if resp.status != 201:
            raise RuntimeError(f"creating tenant {name}: HTTP {resp.status} {tenant}")
    async with session.post(f"{admin}/tenants/{tenant['id']}/keys", headers=admin_headers) as resp:
        key = await resp.json()
        if resp.status != 201:
            raise RuntimeError(f"creating a key for {name}: HTTP {resp.status} {key}")
    return str(key["key"])


def prompt_for(spec: RequestSpec) -> list[int]:
    """The exact prompt of *spec*: token ids from its rid (no prefix shared across requests)."""
    seed = zlib.crc32(spec.rid.encode())
    return [10 + (seed + 7919 * j) % 251 for j in range(spec.prompt_len)]


async def replay(
    session: aiohttp.ClientSession,
    base_url: str,
    keys: TenantKeys,
    source: SpecSource,
    window_s: float,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> tuple[list[RequestRecord], float]:
    """Replays *source* on the wall clock (closed-loop sources get each finish at once); a
    request still running *drain_timeout_s* after the window is cancelled and counted
    unfinished."""
    window = window_s
    t0 = time.perf_counter()
    pending: dict[asyncio.Task[RequestRecord], RequestSpec] = {}
    records: list[RequestRecord] = []
    while True:
        now = time.perf_counter() - t0
        for spec in source.pop_due(now):
            key = await keys.key_for(spec)
            pending[asyncio.create_task(send(session, base_url, key, spec, t0))] = spec
        if source.exhausted and not pending:
            break
        if now > window + drain_timeout_s:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            records += [_unfinished(spec) for spec in pending.values()]
            break
        nxt = source.next_arrival_s()
        wait_s = 0.5 if nxt is None else max(0.0, nxt - now)
        if not pending:
            await asyncio.sleep(min(wait_s, 0.5))
            continue
        done, _ = await asyncio.wait(
            list(pending), timeout=min(wait_s, 0.5), return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            spec = pending.pop(task)
            try:
                record = task.result()
            except (aiohttp.ClientError, TimeoutError, RequestFailed):
                # A request that fails or times out is a miss; the replay carries on.
                record = _unfinished(spec)
            records.append(record)
            source.on_finish(spec.rid, time.perf_counter() - t0)
    records.sort(key=lambda r: r.arrival_s)
    return records, time.perf_counter() - t0


async def send(
    session: aiohttp.ClientSession, base_url: str, key: str, spec: RequestSpec, t0: float
) -> RequestRecord:
    """One request, streamed; its record (times from the start of the replay)."""
    body = {
        "model": "tandem-tiny",
        "prompt": prompt_for(spec),
        "max_tokens": spec.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        # every token step has an event with the running usage, also one whose bytes make
        # no text yet (a random model's tokens often end mid-character: timed by text, such a
        # request's first token would come seconds late)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    arrival = time.perf_counter() - t0
    chunk_times: list[float] = []
    generated = 0
    async with session.post(
        f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        if resp.status == 429 and (await _error_code(resp)) == "slo_unattainable":
            return _unfinished(spec, admission="shed")  # refused before reaching the engine
        if resp.status != 200:
            raise RequestFailed(f"{spec.rid}: HTTP {resp.status} {await resp.text()}")
        downgraded = DOWNGRADED_HEADER in resp.headers
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage")
            if usage and int(usage["completion_tokens"]) > generated:
                now = time.perf_counter() - t0
                chunk_times += [now] * (int(usage["completion_tokens"]) - generated)
                generated = int(usage["completion_tokens"])
    finish = time.perf_counter() - t0
    return RequestRecord(
        rid=spec.rid,
        tier="be" if downgraded else spec.tier,  # it ran as BE, as the simulator records it
        arrival_s=spec.arrival_s if spec.rid != "warm-up" else arrival,
        prompt_len=spec.prompt_len,
        output_len_target=spec.output_len,
        generated=generated,
        first_token_s=chunk_times[0] if chunk_times else None,
        finish_s=finish,
        token_times=array("d", chunk_times),  # one per token counted, in order
        evictions=0,
        cached_tokens=0,
        ttft_target_s=spec.ttft_target_s,
        tpot_target_s=spec.tpot_target_s,
        deadline_s=None if spec.deadline_s is None else spec.arrival_s + spec.deadline_s,
        length_key=spec.length_key,
        max_new_tokens=spec.max_new_tokens,
        admitted_s=chunk_times[0] if chunk_times else None,
        admission="downgraded" if downgraded else "admitted",
    )


async def _error_code(resp: aiohttp.ClientResponse) -> str | None:
    """The OpenAI error body's `code` (None when the body is not one)."""
    try:
        body = await resp.json(content_type=None)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _unfinished(spec: RequestSpec, admission: Admission = "admitted") -> RequestRecord:
    """The record of a request that produced nothing: failed, timed out, or shed."""
    return RequestRecord(
        rid=spec.rid,
        tier=spec.tier,
        arrival_s=spec.arrival_s,
        prompt_len=spec.prompt_len,
        output_len_target=spec.output_len,
        generated=0,
        first_token_s=None,
        finish_s=None,
        token_times=array("d"),
        evictions=0,
        cached_tokens=0,
        ttft_target_s=spec.ttft_target_s,
        tpot_target_s=spec.tpot_target_s,
        deadline_s=None,
        length_key=spec.length_key,
        max_new_tokens=spec.max_new_tokens,
        admission=admission,
    )


async def replay_source(
    base_url: str, admin_token: str, source: SpecSource, window_s: float, drain_s: float
) -> tuple[list[RequestRecord], float]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=DRAIN_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        keys = TenantKeys(base_url, admin_token, session)
        return await replay(session, base_url, keys, source, window_s, drain_s)
