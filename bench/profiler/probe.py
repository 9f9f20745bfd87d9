"""HTTP probes for the profiler: what the engine is, streamed generations with arrival times,
and the statistics over them.

Speaks only the engine's HTTP surface (SGLang's native API, which tandem's simulator also
serves): ``POST /generate`` with ``input_ids`` and ``stream: true``; optionally ``/model_info``,
``/server_info`` (or ``/v1/loads``), ``/flush_cache`` and ``/abort_request``. An endpoint the
engine lacks is skipped (its facts fall back to defaults the caller may override).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from backend.policy.latency import BatchShape

DEFAULT_VOCAB = 1000  # when the engine does not tell: every real vocabulary is larger
FIRST_ID = 16  # random prompts avoid the lowest ids, where special tokens live
HTTP_READ_TIMEOUT_S = 120.0
SPREAD_LIMIT = 1.3  # runs of one point further apart than this (max/min) get more runs
T = TypeVar("T")


class ProfilerError(RuntimeError):
    """A user-facing failure of the profiler (engine unreachable, a request refused, ...)."""


@dataclass(frozen=True)
class EngineFacts:
    """What the profiler needs to know about the engine before it sends anything."""

    vocab_size: int
    """Random prompt ids are drawn below this."""
    kv_capacity_tokens: int
    """KV pool size, tokens (max_total_num_tokens)."""
    max_running_requests: int
    """Largest decode batch the engine admits."""
    chunked_prefill_size: int
    """Largest prefill per iteration, tokens; longer prompts run in several iterations."""
    page_size: int
    """KV allocation granularity, tokens."""
    context_length: int | None
    """Longest sequence, tokens (None: unknown)."""
    dtype: str | None
    """Model dtype as the engine reports it."""
    model: dict[str, Any] = field(default_factory=dict)
    """Model facts (type, architecture, shape from its config.json when readable)."""
    dp_size: int = 1
    """SGLang data-parallel ranks: each has its own scheduler and KV pool, so the profiler sends
    every probe to rank 0 (`routed_dp_rank`) — a batch split between ranks would be measured as
    one twice its size's. The ranks are alike; rank 0's profile is theirs."""

    @property
    def kv_bytes_per_token(self) -> int | None:
        """2·layers·kv_heads·head_dim·dtype bytes, when the model config is known."""
        size = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2}.get(self.dtype or "")
        keys = ("num_hidden_layers", "num_key_value_heads", "head_dim")
        if size is None or not all(isinstance(self.model.get(k), int) for k in keys):
            return None
        layers, kv_heads, head_dim = (int(self.model[k]) for k in keys)
        return 2 * layers * kv_heads * head_dim * size


async def get_json(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """GET a JSON object (with *headers*, if any); None for a 4xx/5xx or a body that is not a
    JSON object."""
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            return None
        try:
            body = await resp.json(content_type=None)
        except (ValueError, aiohttp.ContentTypeError):
            return None
    return body if isinstance(body, dict) else None


async def engine_prefill_busy_s(
    session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str] | None = None
) -> float | None:
    """The engine's own cumulative prefill step time, seconds (SGLang's /v1/loads
    ``total_prefill_busy_us``), or None when the engine does not report it."""
    try:
        loads = await get_json(session, base_url + "/v1/loads", headers)
    except aiohttp.ClientError:
        return None
    entries = (loads or {}).get("loads")
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        return None
    busy_us = entries[0].get("total_prefill_busy_us")
    return busy_us / 1e6 if isinstance(busy_us, int | float) else None


async def discover(
    session: aiohttp.ClientSession, base_url: str, vocab_size: int | None = None
) -> EngineFacts:
    """Reads the engine's facts; raises ProfilerError when nothing answers at *base_url*."""
    try:
        model_info = await get_json(session, base_url + "/model_info") or {}
        server = await get_json(session, base_url + "/server_info")
        loads = await get_json(session, base_url + "/v1/loads") if server is None else None
    except (aiohttp.ClientError, OSError, TimeoutError):
        raise ProfilerError(
            f"engine not reachable at {base_url} (is it running? `tandem "
            "serve` starts it; or pass --url, or --launch)"
        ) from None
    server = server or {}
    if loads and isinstance(loads.get("loads"), list) and loads["loads"]:
        server = {**loads["loads"][0], **server}
    config = _model_config(model_info.get("model_path"))
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    )
    model: dict[str, Any] = {k: config[k] for k in keys if k in config}
    if "head_dim" in config or ("hidden_size" in config and "num_attention_heads" in config):
        model["head_dim"] = config.get("head_dim") or (
            config["hidden_size"] // config["num_attention_heads"]
        )
    model.update(
        {
            k: model_info[k]
            for k in ("model_type", "architectures", "served_model_name")
            if model_info.get(k) is not None
        }
    )
    vocab = vocab_size or config.get("vocab_size") or DEFAULT_VOCAB
    return EngineFacts(
        vocab_size=int(vocab),
        kv_capacity_tokens=int(
            server.get("max_total_num_tokens") or server.get("max_total_tokens") or 0
        ),
        max_running_requests=int(server.get("max_running_requests") or 16),
        chunked_prefill_size=int(server.get("chunked_prefill_size") or 512),
        page_size=int(server.get("page_size") or 1),
        context_length=server.get("context_length") or config.get("max_position_embeddings"),
        dtype=server.get("dtype") if server.get("dtype") != "auto" else config.get("torch_dtype"),
        model=model,
        dp_size=max(1, int(server.get("dp_size") or 1)),
    )


def _model_config(model_path: object) -> dict[str, Any]:
    """The model's config.json when the engine's model_path is readable here, else {}."""
    if not isinstance(model_path, str):
        return {}
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class Stream:
    """One generation as the client saw it."""

    rid: str
    """Request id sent to the engine (used to abort it)."""
    prompt_len: int
    """Prompt tokens sent."""
    sent_at: float
    """perf_counter() when the request was sent."""
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    """(perf_counter() at arrival, output tokens so far) for every streamed chunk."""
    cached_tokens: int = 0
    """Prompt tokens the engine served from its prefix cache (meta_info.cached_tokens)."""
    is_done: bool = False
    """The stream ended (finished, aborted or failed)."""

    @property
    def tokens(self) -> int:
        """Output tokens received so far."""
        return self.arrivals[-1][1] if self.arrivals else 0

    @property
    def ttft_s(self) -> float:
        """Time from sending to the first chunk, seconds."""
        return self.arrivals[0][0] - self.sent_at


class Prober:
    """Sends generations with random prompts and records when their tokens arrive."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, facts: EngineFacts, seed: int
    ) -> None:
        self.session = session
        self.base_url = base_url
        self.facts = facts
        self._rng = random.Random(seed)
        self.changed = asyncio.Condition()
        """Notified whenever any stream receives a chunk or ends."""
        self.before_probe: Callable[[], Awaitable[None]] | None = None
        """Awaited at the end of every `settle` (e.g. to wait for a quiet machine)."""

    def random_prompt(self, length: int) -> list[int]:
        """Fresh random token ids (a new prompt shares no prefix with earlier ones)."""
        low = min(FIRST_ID, self.facts.vocab_size // 2)
        return [self._rng.randrange(low, self.facts.vocab_size) for _ in range(length)]

    def start(self, prompt: list[int], max_new_tokens: int) -> tuple[Stream, asyncio.Task[None]]:
        """Sends one streamed generation; returns its record and the task that fills it."""
        stream = Stream(
            rid=f"profile-{uuid.uuid4().hex}", prompt_len=len(prompt), sent_at=time.perf_counter()
        )
        body = {
            "rid": stream.rid,
            "input_ids": prompt,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        }
        if self.facts.dp_size > 1:
            body["routed_dp_rank"] = 0  # the batch measured is the batch one scheduler runs
        return stream, asyncio.create_task(self._run(stream, body))

    async def _run(self, stream: Stream, body: dict[str, Any]) -> None:
        try:
            async with self.session.post(self.base_url + "/generate", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise ProfilerError(f"/generate answered {resp.status}: {text}")
                async for line in resp.content:
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        raise ProfilerError(f"/generate failed: {chunk['error']}")
                    meta = chunk.get("meta_info") or {}
                    tokens = meta.get("completion_tokens")
                    if tokens is None:  # engines without meta_info: count the chunks
                        tokens = stream.tokens + 1
                    stream.cached_tokens = int(meta.get("cached_tokens") or 0)
                    stream.arrivals.append((now, int(tokens)))
                    await self._notify()
        finally:
            stream.is_done = True
            await self._notify()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Waits until *predicate* holds (re-checked on every chunk); ProfilerError on timeout."""
        try:
            async with asyncio.timeout(timeout_s), self.changed:
                await self.changed.wait_for(predicate)
        except TimeoutError:
            raise ProfilerError(f"timed out after {timeout_s:.0f} s waiting for {what}") from None

    async def prefill_busy_s(self) -> float | None:
        """The engine's own cumulative prefill step time, seconds (SGLang's /v1/loads
        ``total_prefill_busy_us``), or None when the engine does not report it."""
        return await engine_prefill_busy_s(self.session, self.base_url)

    async def abort(self, streams: list[Stream], tasks: list[asyncio.Task[None]]) -> None:
        """Stops generations that are still running (abort request, then disconnect)."""
        for stream in streams:
            if not stream.is_done:
                try:
                    async with self.session.post(
                        self.base_url + "/abort_request", json={"rid": stream.rid}
                    ):
                        pass
                except aiohttp.ClientError:
                    pass  # disconnecting below aborts it too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Waits until the engine is idle and empties its prefix cache.

        ``/flush_cache`` succeeds only on an idle engine, so it doubles as the idle check; an
        engine without it (404) just gets a short pause."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self.session.post(self.base_url + "/flush_cache") as resp:
                    if resp.status in (200, 404, 405):
                        if resp.status != 200:
                            await asyncio.sleep(0.3)
                        if self.before_probe is not None:
                            await self.before_probe()
                        return
            except aiohttp.ClientError as exc:
                raise ProfilerError(f"engine stopped answering: {exc}") from None
            if time.monotonic() > deadline:
                raise ProfilerError(f"engine still busy after {timeout_s:.0f} s")
            await asyncio.sleep(0.1)


def client_session(headers: Mapping[str, str] | None = None) -> aiohttp.ClientSession:
    """An HTTP session with a connection pool big enough for every concurrent stream; *headers*
    go with every request (the engine's API key, `EngineConfig.auth_headers`)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=HTTP_READ_TIMEOUT_S)
    return aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=headers
    )


async def repeat_until_stable(
    run: Callable[[], Awaitable[T]], repeats: int, seconds: Callable[[T], float]
) -> list[T]:
    """`repeats` runs of a probe, and more (up to 2·repeats + 1) until `repeats` of them lie
    within ±(SPREAD_LIMIT − 1)/2 of their median: a burst of other work on the machine then
    cannot carry the median."""
    results = [await run() for _ in range(repeats)]
    while len(results) < 2 * repeats + 1:
        times = [seconds(r) for r in results]
        middle = statistics.median(times)
        band = (SPREAD_LIMIT - 1) / 2 * middle
        if sum(abs(t - middle) <= band for t in times) >= repeats:
            break
        results.append(await run())
    return results


def steady_gap(streams: Sequence[Stream], first_token: int, last_token: int) -> float:
    """Median time per token between output tokens first_token and last_token (a chunk that
    carries n tokens counts its gap n times, divided by n)."""
    per_token: list[float] = []
    for stream in streams:
        arrivals = [a for a in stream.arrivals if first_token <= a[1] <= last_token]
        for (t0, n0), (t1, n1) in itertools.pairwise(arrivals):
            per_token += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    if not per_token:
        raise ProfilerError("no steady decode window (streams too short)")
    return statistics.median(per_token)


def median_run(runs: list[tuple[BatchShape, float]]) -> tuple[BatchShape, float]:
    """The run with the median time (its own shape, so shape and time stay paired)."""
    ordered = sorted(runs, key=lambda run: run[1])
    return ordered[(len(ordered) - 1) // 2]
