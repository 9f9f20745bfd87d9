"""The new user's scenario on the real engine: the README's chat tenant while a batch runs.

A user who follows the README starts `tandem serve` (the built-in tiny model on this CPU, the
default config: patched SGLang, tandem's policy, the engine profile measured on first start),
creates an RT tenant with the README's contract (TTFT 500 ms, TPOT 100 ms) and a BE tenant, and
chats. This study does exactly that, through the OpenAI API, once per policy, on a fresh
`tandem serve` each:

1. **alone** — `--chats` sequential streamed chats, nothing else running;
2. **beside a batch** — a Batch API batch of `--batch-lines` lines (`--batch-max-tokens` each)
   is created; once the engine runs its lines, the same chats again, one after the other,
   for as long as the batch runs (a policy that finishes it first is measured on the chats
   sent before it ended, `batch_ended_during_chats`, not on chats that ran alone);
3. **under a CPU burner** (tandem only, `--burn-s` > 0) — with the batch still running,
   `--burners` processes (default one) that spin on the CPU start; the chats go on for
   `--burn-s` seconds while the study follows the engine's per-iteration state (`/load`: the
   measured iteration time, and what the calibrated model predicted for it) to see how fast
   the prediction error comes back within 20 %;
4. the batch is waited for to the end and its output file checked line by line;
5. **alone again** — the same chats once more, nothing else running: the host's own pace can
   move in the minutes between the first phase and the batch's end (another tenant of the
   machine, thermal limits), so the chats beside the batch are compared with both phases
   alone, before and after (`*_ratio_bracketed`: beside ÷ the mean of the two alone p50s), as
   well as with the first (`*_ratio`: the issue's measure).

Chats stream with `continuous_usage_stats`, and the client stamps every token when the event
that counts it arrives (not when text arrives: a token ending mid-character has no text until
the next one): TTFT is the first token's arrival from the request's start, TPOT the mean gap
between the first and the last token. Every chat asks
`ignore_eos` so it always produces `--chat-max-tokens` tokens (the dummy-weight model would
otherwise stop at random), and so do the batch lines.

Reported per policy (``results.json`` and ``README.md`` under ``--out``): TTFT and TPOT p50 of
each phase and the ratios of the phase beside the batch to the phases alone, the chats that met
the contract, the chats the gateway refused (429 `slo_unattainable`) or downgraded, the batch's
outcome and duration, the engine's latency calibration; for the burner, the prediction error's
timeline and the seconds it took to come back within 20 %.

    python -m bench.studies.new_user                       # tandem and stock SGLang (fcfs)
    python -m bench.studies.new_user --policies tandem --burn-s 40

Every process the study starts (the servers, the burners) is stopped when it ends or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from backend.policy.tandem.config import TandemConfig
from bench.calibration_recovery import (
    ERROR_BAND,
    ERROR_WINDOW_S,
    error_timeline,
    excursions,
    ratio_timeline,
    recovery_s,
)
from bench.live import READY_TIMEOUT_S, engine_control_get, follow_iterations, served
from bench.live_client import create_tenant_key
from bench.policy_spec import base_name, parse_policy_spec
from common.config import DEFAULT_CONFIG_PATH
from common.sockets import free_port
from common.wire import CONTROL_LOAD_PATH, CONTROL_STATS_PATH, IterationRecord

MODEL = "tandem-tiny"
README_CONTRACT = {"ttft_ms": 500, "tpot_ms": 100}
"""The README's chat tenant (`tandem admin tenant create chat --tier rt --ttft-ms 500
--tpot-ms 100`)."""
BATCH_TIMEOUT_S = 1800.0
POLICIES = ("tandem", "fcfs")
CHAT_PROMPT = "Hello! Can you tell me a bit about how large language models are served?"
DOCUMENT = (
    "Quarterly report. Revenue grew in every region; the northern division opened two plants, "
    "the southern division closed one and moved its staff. Costs rose with energy prices. "
)


@dataclass
class Chat:
    """One streamed chat as the client saw it."""

    status: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    downgraded: str | None = None
    error_code: str | None = None
    started_s: float = 0.0
    """When it was sent, seconds from the phase's start."""
    retry_after_s: float | None = None
    """A refusal's `Retry-After`, seconds."""

    def met(self, contract: dict[str, float]) -> bool:
        """Served as RT within the contract's TTFT and TPOT."""
        return (
            self.status == 200
            and self.downgraded is None
            and self.ttft_s is not None
            and self.ttft_s * 1000 <= contract["ttft_ms"]
            and (self.tpot_s is None or self.tpot_s * 1000 <= contract["tpot_ms"])
        )


@dataclass
class Phase:
    """The chats of one phase and what they add up to."""

    name: str
    chats: list[Chat] = field(default_factory=list)
    started_unix_s: float | None = None
    """When its first chat was sent (wall clock): the chats' `started_s` count from here."""

    def summary(self, contract: dict[str, float]) -> dict[str, Any]:
        served_rt = [c for c in self.chats if c.status == 200 and c.downgraded is None]
        ttfts = [c.ttft_s for c in served_rt if c.ttft_s is not None]
        tpots = [c.tpot_s for c in served_rt if c.tpot_s is not None]
        return {
            "chats": len(self.chats),
            "served_rt": len(served_rt),
            "refused": sum(c.status == 429 for c in self.chats),
            "downgraded": sum(c.downgraded is not None for c in self.chats),
            "failed": sum(c.status not in (200, 429) for c in self.chats),
            "met": sum(c.met(contract) for c in self.chats),
            "admitted_attainment": (
                sum(c.met(contract) for c in served_rt) / len(served_rt) if served_rt else None
            ),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "tpot_p50_s": statistics.median(tpots) if tpots else None,
        }


# --- the client side -----------------------------------------------------------------------


async def chat(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    max_tokens: int,
    t0: float,
    prompt: str = CHAT_PROMPT,
) -> Chat:
    """One streamed chat completion of *prompt*; its timings from the client's clock."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        # an event for every token with the running usage: the client times tokens, not text
        # (the tiny model's random tokens often end mid-character, and such a token's text
        # comes with the next one: timed by text, a chat's first token would sometimes come
        # one iteration late, more often beside the batch, whose batches change the numerics)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    started = time.perf_counter()
    stamps: list[float] = []
    async with session.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as resp:
        record = Chat(
            status=resp.status,
            downgraded=resp.headers.get("X-Tandem-Downgraded"),
            started_s=started - t0,
        )
        if resp.status != 200:
            if "Retry-After" in resp.headers:
                record.retry_after_s = float(resp.headers["Retry-After"])
            try:
                record.error_code = (await resp.json())["error"]["code"]
            except (aiohttp.ContentTypeError, KeyError, TypeError, ValueError):
                record.error_code = f"HTTP {resp.status}"
            return record
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage")
            if usage and int(usage["completion_tokens"]) > len(stamps):
                stamps += [time.perf_counter()] * (int(usage["completion_tokens"]) - len(stamps))
    record.tokens = len(stamps)
    if stamps:
        record.ttft_s = stamps[0] - started
    if len(stamps) > 1:
        record.tpot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return record


async def chats_in_a_row(
    session: aiohttp.ClientSession,
    base_url: str,
    key: str,
    phase: Phase,
    *,
    count: int | None = None,
    for_s: float | None = None,
    max_tokens: int,
    while_: Callable[[], Awaitable[bool]] | None = None,
) -> Phase:
    """Sequential chats: *count* of them, or as many as start within *for_s* seconds, and only
    while *while_* holds (checked before each chat: the batch still runs). After a 429 the next
    chat waits for its `Retry-After`, as the OpenAI client libraries do."""
    t0 = time.perf_counter()
    if phase.started_unix_s is None:
        phase.started_unix_s = time.time()
    while True:
        if count is not None and len(phase.chats) >= count:
            return phase
        if for_s is not None and time.perf_counter() - t0 >= for_s:
            return phase
        if while_ is not None and not await while_():
            return phase
        record = await chat(session, base_url, key, max_tokens, t0)
        phase.chats.append(record)
        if record.retry_after_s:
            await asyncio.sleep(record.retry_after_s)


class Gateway:
    """The gateway as an operator and its tenants use it (admin API, Files and Batch API)."""

    def __init__(self, base_url: str, admin_token: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url
        self.session = session
        self._admin = {"Authorization": f"Bearer {admin_token}"}

    async def tenant(self, name: str, tier: str, slo: dict[str, Any]) -> str:
        """A new tenant and a key for it; the key."""
        return await create_tenant_key(self.session, self.base_url, self._admin, name, tier, slo)

    async def create_batch(self, key: str, lines: int, max_tokens: int) -> str:
        """Uploads a batch input file of *lines* chat lines and creates the batch; its id."""
        content = b"".join(
            json.dumps(
                {
                    "custom_id": f"doc-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": MODEL,
                        "messages": [
                            {"role": "user", "content": f"Summarise document {i}: " + DOCUMENT * 3}
                        ],
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                    },
                }
            ).encode()
            + b"\n"
            for i in range(lines)
        )
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", content, filename="docs.jsonl", content_type="application/jsonl")
        auth = {"Authorization": f"Bearer {key}"}
        async with self.session.post(f"{self.base_url}/v1/files", data=form, headers=auth) as r:
            file = await r.json()
            if r.status != 200:
                raise RuntimeError(f"uploading the batch file: HTTP {r.status} {file}")
        body = {
            "input_file_id": file["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        async with self.session.post(f"{self.base_url}/v1/batches", json=body, headers=auth) as r:
            batch = await r.json()
            if r.status != 200:
                raise RuntimeError(f"creating the batch: HTTP {r.status} {batch}")
        return str(batch["id"])

    async def batch(self, key: str, batch_id: str) -> dict[str, Any]:
        async with self.session.get(
            f"{self.base_url}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {key}"}
        ) as r:
            body: dict[str, Any] = await r.json()
            if r.status != 200:
                raise RuntimeError(f"reading batch {batch_id}: HTTP {r.status} {body}")
            return body

    async def output_lines(self, key: str, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        async with self.session.get(
            f"{self.base_url}/v1/files/{file_id}/content",
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"reading file {file_id}: HTTP {r.status} {text[:200]}")
        # JSONL lines end at "\n" only: the random model's text may hold U+2028 and its kin,
        # which str.splitlines also splits on
        return [json.loads(line) for line in text.split("\n") if line.strip()]


async def wait_for(predicate: Any, timeout_s: float, what: str, every_s: float = 0.5) -> Any:
    """Polls the coroutine function *predicate* until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(every_s)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


# --- the engine's per-iteration state (for the burner phase) ------------------------------


def _spin(niceness: int) -> None:  # pragma: no cover - runs in the burner processes
    os.nice(niceness)
    while True:
        pass


@contextmanager
def cpu_burners(count: int, niceness: int = 0) -> Iterator[list[multiprocessing.Process]]:
    """*count* processes spinning on the CPU at *niceness* until the block ends (killed also on
    errors)."""
    procs = [
        multiprocessing.Process(target=_spin, args=(niceness,), daemon=True) for _ in range(count)
    ]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(timeout=10)


# --- one policy ----------------------------------------------------------------------------


@dataclass
class Options:
    chats: int = 10
    chat_max_tokens: int = 32
    batch_lines: int = 50
    batch_max_tokens: int = 200
    burn_s: float = 0.0
    burners: int = 1
    """CPU-spinning processes of the burner phase (the issue's scenario: one)."""
    burner_nice: int = 0
    """Their niceness: 0 competes with the engine as an equal (on 2 cores that makes the
    engine's iterations 7-40× slower), higher values model a milder neighbour."""
    profile: str = "auto"
    """The tandem engine's profile (`auto`: measured for this engine on first start, cached)."""
    contract: dict[str, float] = field(default_factory=lambda: dict(README_CONTRACT))
    """The chat tenant's SLO contract (ttft_ms, tpot_ms)."""


def config_for(policy: str, workdir: Path, options: Options) -> tuple[dict[str, Any], int]:
    """The default config (config.yaml) with a fresh database, free ports and *policy*'s engine
    settings; and the gateway's port."""
    cfg: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    port = free_port()
    cfg["gateway"]["port"] = port
    cfg["database"]["url"] = f"sqlite+aiosqlite:///{workdir / 'tandem.db'}"
    engine = cfg["engine"]
    engine.update(
        port=free_port(), log_file=str(workdir / "engine.log"), startup_timeout_s=READY_TIMEOUT_S
    )
    name, extra = parse_policy_spec(policy)
    if name == "tandem":  # tandem:KEY=VALUE… overrides config.yaml's policy options
        engine["profile"] = options.profile
        engine["policy_options"] = {**(engine.get("policy_options") or {}), **extra}
    elif extra:
        raise ValueError(f"{policy}: options are for tandem only (stock SGLang takes none)")
    else:  # stock SGLang: the patch off, its own FCFS (or priority) scheduling
        engine.update(patch=False, policy="none", profile="auto")
        engine["enable_priority_scheduling"] = name == "priority"
    return cfg, port


def run_policy(policy: str, out_dir: Path, options: Options) -> dict[str, Any]:
    """The scenario on a fresh `tandem serve` of *policy*; its results."""
    workdir = out_dir / re.sub(r"[^A-Za-z0-9_.=-]+", "_", policy)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tandem.db").unlink(missing_ok=True)
    cfg, port = config_for(policy, workdir, options)
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_hex(16)
    engine_port = int(cfg["engine"]["port"])
    started = time.monotonic()
    with served(config_path, token, workdir / "gateway.log", port) as base_url:
        ready_s = time.monotonic() - started
        print(f"[{policy}] serving after {ready_s:.0f} s", file=sys.stderr)
        result = asyncio.run(_scenario(policy, base_url, token, engine_port, options))
    result["ready_s"] = round(ready_s, 1)
    # kept beside the result, not in it: thousands of rows
    (workdir / "iterations.json").write_text(json.dumps(result.pop("iterations")))
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    return result


async def _scenario(
    policy: str, base_url: str, token: str, engine_port: int, options: Options
) -> dict[str, Any]:
    contract = options.contract
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        gw = Gateway(base_url, token, session)
        chat_key = await gw.tenant("chat", "rt", contract)
        docs_key = await gw.tenant("docs", "be", {})

        def say(line: str) -> None:
            print(f"[{policy}] {line}", file=sys.stderr)

        n, mt = options.chats, options.chat_max_tokens
        # the engine's iterations while the chats run alone and beside the batch: where a
        # chat's first token went is looked up in them (`iterations.json`)
        records: list[IterationRecord] = []
        stop_following = asyncio.Event()
        follower = asyncio.create_task(
            follow_iterations(engine_port, records, stop_following, every_s=1.0)
        )
        await chats_in_a_row(session, base_url, chat_key, Phase("warm-up"), count=2, max_tokens=mt)
        alone = await chats_in_a_row(
            session, base_url, chat_key, Phase("alone"), count=n, max_tokens=mt
        )
        say(f"alone: {alone.summary(contract)}")

        batch_id = await gw.create_batch(docs_key, options.batch_lines, options.batch_max_tokens)
        batch_started = time.monotonic()

        async def be_running() -> bool:
            status, load = await asyncio.to_thread(
                engine_control_get, engine_port, CONTROL_LOAD_PATH, 5.0
            )
            if status == 200 and isinstance(load, dict):
                return bool(load.get("num_be_running"))
            # stock SGLang has no control endpoint: the batch's progress says it runs
            batch = await gw.batch(docs_key, batch_id)
            return bool(batch["status"] == "in_progress")

        async def batch_runs() -> bool:
            batch = await gw.batch(docs_key, batch_id)
            return bool(batch["status"] in ("validating", "in_progress"))

        await wait_for(be_running, 300, "the batch's lines to run on the engine")
        before = await gw.batch(docs_key, batch_id)
        # Only chats started while the batch still runs: a policy that finishes it first (stock
        # SGLang serves its prompts ahead of the chats) would otherwise be measured on chats
        # that ran alone.
        beside = await chats_in_a_row(
            session,
            base_url,
            chat_key,
            Phase("beside_batch"),
            count=n,
            max_tokens=mt,
            while_=batch_runs,
        )
        after = await gw.batch(docs_key, batch_id)
        stop_following.set()
        await follower
        say(f"beside the batch: {beside.summary(contract)}")

        burn: dict[str, Any] | None = None
        if options.burn_s > 0 and base_name(policy) == "tandem":
            burn = await _burn_phase(session, gw, chat_key, engine_port, options, say)

        async def batch_done() -> dict[str, Any] | None:
            b = await gw.batch(docs_key, batch_id)
            return b if b["status"] in ("completed", "failed", "expired", "cancelled") else None

        final = await wait_for(batch_done, BATCH_TIMEOUT_S, "the batch to end", every_s=2.0)
        batch_s = time.monotonic() - batch_started
        lines = await gw.output_lines(docs_key, final.get("output_file_id"))
        alone_after = await chats_in_a_row(
            session, base_url, chat_key, Phase("alone_after"), count=n, max_tokens=mt
        )
        say(f"alone again: {alone_after.summary(contract)}")
        full = sum(
            1
            for line in lines
            if line.get("response", {}).get("status_code") == 200
            and line["response"]["body"]["usage"]["completion_tokens"] == options.batch_max_tokens
        )
        _, stats = await asyncio.to_thread(engine_control_get, engine_port, CONTROL_STATS_PATH, 10)
    a, b, c = alone.summary(contract), beside.summary(contract), alone_after.summary(contract)
    return {
        "policy": policy,
        "contract": contract,
        "options": asdict(options),
        "alone": a,
        "beside_batch": b,
        "alone_after": c,
        "ttft_p50_ratio": _ratio(b["ttft_p50_s"], a["ttft_p50_s"]),
        "tpot_p50_ratio": _ratio(b["tpot_p50_s"], a["tpot_p50_s"]),
        "ttft_p50_ratio_bracketed": _ratio(
            b["ttft_p50_s"], _mean(a["ttft_p50_s"], c["ttft_p50_s"])
        ),
        "tpot_p50_ratio_bracketed": _ratio(
            b["tpot_p50_s"], _mean(a["tpot_p50_s"], c["tpot_p50_s"])
        ),
        "batch_completed_during_chats": after["request_counts"]["completed"]
        - before["request_counts"]["completed"],
        "batch_ended_during_chats": len(beside.chats) < n,
        "batch": {
            "status": final["status"],
            "request_counts": final["request_counts"],
            "lines_with_full_output": full,
            "seconds": round(batch_s, 1),
        },
        "burn": burn,
        "engine_stats": stats if isinstance(stats, dict) else None,
        "chats": {
            "alone": [asdict(c) for c in alone.chats],
            "beside_batch": [asdict(c) for c in beside.chats],
            "alone_after": [asdict(c) for c in alone_after.chats],
        },
        "iterations": {
            "phase_started_unix_s": {
                "alone": alone.started_unix_s,
                "beside_batch": beside.started_unix_s,
            },
            "records": msgspec.to_builtins(records),
        },
    }


async def _burn_phase(
    session: aiohttp.ClientSession,
    gw: Gateway,
    chat_key: str,
    engine_port: int,
    options: Options,
    say: Any,
) -> dict[str, Any]:
    """Chats for `burn_s` seconds with CPU burners started after the first quarter of it; the
    per-iteration prediction error around the start."""
    records: list[IterationRecord] = []
    stop = asyncio.Event()
    follower = asyncio.create_task(follow_iterations(engine_port, records, stop))
    lead_s = options.burn_s / 4
    phase = Phase("burn")
    before_phase = Phase("before_burn")
    try:
        await chats_in_a_row(
            session,
            gw.base_url,
            chat_key,
            before_phase,
            for_s=lead_s,
            max_tokens=options.chat_max_tokens,
        )
        burners = options.burners
        burn_start = time.time()
        with cpu_burners(burners, options.burner_nice):
            await chats_in_a_row(
                session,
                gw.base_url,
                chat_key,
                phase,
                for_s=options.burn_s - lead_s,
                max_tokens=options.chat_max_tokens,
            )
    finally:
        stop.set()
        await follower
    samples = [
        {
            "at_unix_s": r.at_unix_s,
            "measured_s": r.iteration_s,
            "predicted_s": r.predicted_iteration_s,
            # the plan's token mix (`common.wire.IterationMix`, field order): with the profile,
            # the model's uncorrected prediction, so a calibration can be replayed on the run
            "mix": None if r.mix is None else list(msgspec.structs.astuple(r.mix)),
        }
        for r in records
    ]
    timeline = error_timeline(samples, ERROR_WINDOW_S)
    ratios = ratio_timeline(samples, ERROR_WINDOW_S)
    before = [e for t, e in timeline if t < burn_start]
    summary = phase.summary(options.contract)
    # the whole phase: the chats before the burner and under it ("stays ≥ 0.95")
    whole = Phase("whole", before_phase.chats + phase.chats).summary(options.contract)
    back_s = recovery_s(timeline, burn_start, ERROR_BAND)
    ratio_back_s = recovery_s(ratios, burn_start, ERROR_BAND)
    spells = excursions(timeline, burn_start, ERROR_BAND)
    say(
        f"burn: {summary}, error back within {ERROR_BAND:.0%} after {back_s} s "
        f"(median ratio: {ratio_back_s} s; {len(spells)} spells above it); whole phase {whole}"
    )
    return {
        "burners": burners,
        "burner_nice": options.burner_nice,
        "burn_start_unix_s": burn_start,
        "chats": summary,
        "chats_before_burn": before_phase.summary(options.contract),
        "chats_whole_phase": whole,
        "ratio_p50_before": statistics.median(e for t, e in ratios if t < burn_start)
        if any(t < burn_start for t, _ in ratios)
        else None,
        "ratio_p50_back_within_band_s": ratio_back_s,
        "ratio_timeline": [
            {"t_s": round(t - burn_start, 3), "error": round(e, 4)} for t, e in ratios
        ],
        "chat_log": [asdict(c) for c in phase.chats],
        "error_before_p50": statistics.median(before) if before else None,
        "error_back_within_band_s": back_s,
        "error_excursions": spells,
        "iterations": len(samples),
        "timeline": [{"t_s": round(t - burn_start, 3), "error": round(e, 4)} for t, e in timeline],
        "samples": samples,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def _mean(a: float | None, b: float | None) -> float | None:
    """The mean of two phases' p50s (one alone when the other has none)."""
    kept = [v for v in (a, b) if v is not None]
    return sum(kept) / len(kept) if kept else None


# --- report ----------------------------------------------------------------------------------


def report(results: list[dict[str, Any]], command: str) -> str:
    """The README of a run: one table row per policy, then the burner."""

    def ms(v: float | None) -> str:  # a CPU chat's token takes a few ms: one decimal there
        if v is None:
            return "–"
        return f"{v * 1000:.1f}" if v < 0.1 else f"{v * 1000:.0f}"

    lines = [
        "# The new user's scenario on the real engine",
        "",
        f"`{command}`",
        "",
        "| policy | TTFT p50 alone / beside batch / alone again (ms) | ratio (bracketed) "
        "| TPOT p50 alone / beside / alone again (ms) | ratio (bracketed) | met alone "
        "| met beside | refused | batch | batch s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, b, c = r["alone"], r["beside_batch"], r["alone_after"]
        counts = r["batch"]["request_counts"]
        lines.append(
            f"| {r['policy']} | {ms(a['ttft_p50_s'])} / {ms(b['ttft_p50_s'])} / "
            f"{ms(c['ttft_p50_s'])} | {r['ttft_p50_ratio']} ({r['ttft_p50_ratio_bracketed']}) "
            f"| {ms(a['tpot_p50_s'])} / {ms(b['tpot_p50_s'])} / {ms(c['tpot_p50_s'])} "
            f"| {r['tpot_p50_ratio']} ({r['tpot_p50_ratio_bracketed']}) "
            f"| {a['met']}/{a['chats']} | {b['met']}/{b['chats']} "
            f"| {b['refused']} | {counts['completed']}/{counts['total']} "
            f"({r['batch']['lines_with_full_output']} full) | {r['batch']['seconds']} |"
        )
    for r in results:
        if r.get("batch_ended_during_chats"):
            lines += [
                "",
                f"{r['policy']}: the batch ended after {r['beside_batch']['chats']} of the "
                f"{r['options']['chats']} chats beside it; its ratios rest on those.",
            ]
    for r in results:
        burn = r.get("burn")
        if burn:
            c = burn["chats"]
            lines += [
                "",
                f"Burner ({r['policy']}, {burn['burners']} spinning, nice {burn['burner_nice']}): "
                f"prediction error "
                f"p50 before {burn['error_before_p50']}, back within {ERROR_BAND:.0%} after "
                f"{burn['error_back_within_band_s']} s (|p50 of predicted ÷ measured − 1|: "
                f"back within {ERROR_BAND:.0%} after {burn['ratio_p50_back_within_band_s']} s); "
                f"{_spells_line(burn.get('error_excursions', []))}; "
                f"chats under the burner {c['chats']}, served as RT "
                f"{c['served_rt']}, refused {c['refused']}, admitted attainment "
                f"{c['admitted_attainment']}; the whole phase (before and under the burner) "
                f"{burn['chats_whole_phase']['chats']} chats, admitted attainment "
                f"{burn['chats_whole_phase']['admitted_attainment']}.",
            ]
    return "\n".join(lines) + "\n"


def _spells_line(spells: list[dict[str, float]]) -> str:
    if not spells:
        return "it never left the band under the burner"
    longest = max(spells, key=lambda s: s["duration_s"])
    return (
        f"{len(spells)} spells above the band under the burner, the longest "
        f"{longest['duration_s']} s at {longest['at_s']} s (peak {longest['peak_error']})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.new_user", description=__doc__)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--chats", type=int, default=10)
    parser.add_argument("--chat-max-tokens", type=int, default=32)
    parser.add_argument("--batch-lines", type=int, default=50)
    parser.add_argument("--batch-max-tokens", type=int, default=200)
    parser.add_argument("--burn-s", type=float, default=0.0)
    parser.add_argument("--burners", type=int, default=1)
    parser.add_argument("--burner-nice", type=int, default=0)
    parser.add_argument("--profile", default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results/new_user"))
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if base_name(p) not in ("tandem", "fcfs", "priority")]
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r} (tandem[:KEY=VALUE…], fcfs, priority)")
    for spec in policies:
        try:
            name, extra = parse_policy_spec(spec)
            if name == "tandem":  # a bad option fails now, not after minutes of the run
                unknown_keys = sorted(set(extra) - set(TandemConfig.__struct_fields__))
                if unknown_keys:
                    raise ValueError(f"tandem has no option {unknown_keys[0]!r}")
                msgspec.convert(extra, TandemConfig)
            elif extra:
                raise ValueError("options are for tandem only")
        except (ValueError, msgspec.ValidationError) as exc:
            parser.error(f"--policies {spec!r}: {exc}")
    options = Options(
        chats=args.chats,
        chat_max_tokens=args.chat_max_tokens,
        batch_lines=args.batch_lines,
        batch_max_tokens=args.batch_max_tokens,
        burn_s=args.burn_s,
        burners=args.burners,
        burner_nice=args.burner_nice,
        profile=args.profile,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_policy(p, args.out, options) for p in policies]
    command = "python -m bench.studies.new_user " + " ".join(argv or sys.argv[1:])
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "README.md").write_text(report(results, command.strip()))
    print(report(results, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
