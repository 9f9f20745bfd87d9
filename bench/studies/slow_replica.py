"""One of two real engine replicas slowed by a neighbour: where does each router send RT?

Issue 18's placement on real engines (the simulator's unequal pool is
`bench/results/placement/README.md`). `tandem serve` with ``engine.replicas: 2`` and
config.yaml otherwise (patched SGLang, the built-in tiny model on CPU, tandem's policy, the
profile measured for this engine), each replica's processes pinned to a CPU core of their own
(a replica stands for a machine), and a CPU-spinning process pinned beside replica 1 from the
start of the load to its end: replica 1 runs slower than the profile both plan with, and
nobody tells the gateway. An RT tenant sends streamed chats, Poisson at ``--rate`` req/s, each
with a prompt of its own (no prefix to stick to). Each router (`gateway.router`) gets a fresh
server in turn, with the same arrival times and prompts.

Per router: the chats' attainment (TTFT and TPOT met, over every chat sent and over those
admitted as RT), refusals, TTFT and TPOT percentiles, and per replica the requests it finished
and the pace its calibration learned (measured ÷ profile). The gateway and the client are not
pinned: they share both cores with the replicas, as they would share a host.

    python -m bench.studies.slow_replica --rate 12 --duration-s 60 \
        --out bench/results/placement/live-slow-replica
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from backend.policy.placement import ROUTERS
from bench.live import engine_control_get, served
from bench.studies.new_user import Chat, Gateway, chat, config_for
from bench.studies.new_user import Options as NewUserOptions
from common.sockets import free_consecutive_ports
from common.wire import CONTROL_STATS_PATH

SLOWED = 1
"""The replica the spinning process sits beside."""
WORDS = [
    "serving",
    "latency",
    "batch",
    "tokens",
    "prompt",
    "cache",
    "model",
    "engine",
    "request",
    "queue",
    "schedule",
    "decode",
    "prefill",
    "memory",
    "throughput",
    "tenant",
    "contract",
    "deadline",
    "replica",
    "router",
    "gateway",
]


@dataclass
class Options:
    routers: tuple[str, ...] = ("slo", "round-robin", "least-load")
    rate_req_s: float = 12.0
    duration_s: float = 60.0
    warmup_s: float = 10.0
    """Chats sent before this are left out of the `steady` summary (the calibration and the
    router learn the slowed replica's pace from its first iterations)."""
    chat_max_tokens: int = 32
    prompt_words: tuple[int, int] = (8, 120)
    """Each prompt's length, words, drawn uniformly in [low, high]."""
    burners: int = 1
    """Spinning processes pinned beside the slowed replica."""
    contract: dict[str, float] = field(default_factory=lambda: {"ttft_ms": 300, "tpot_ms": 60})
    seed: int = 0


# --- the host: cores, processes, the neighbour -------------------------------------------------


def two_cores() -> tuple[int, int]:
    """Two CPU cores this process may use (replica 0's, replica 1's); ValueError if it has one."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"needs two CPU cores, this process may use {len(cores)}")
    return cores[0], cores[1]


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def process_group(pgid: int) -> list[int]:
    """The live processes of process group *pgid*."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _proc_stat(int(entry))) and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def engine_pid(port: int) -> int:
    """The main process of the engine listening on *port* (SGLang's launcher, `--port PORT`)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == b"--port" and argv[i + 1] == str(port).encode():
                found.append(int(entry))
    if not found:
        raise RuntimeError(f"no engine process with --port {port}")
    return min(found)


def pin_group(pgid: int, core: int) -> int:
    """Every thread of every process of group *pgid* onto *core*; how many threads."""
    threads = 0
    for pid in process_group(pgid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), {core})
                threads += 1
            except OSError:  # the thread ended meanwhile
                pass
    return threads


def _spin_on(core: int) -> None:  # pragma: no cover - runs in the neighbour's process
    os.sched_setaffinity(0, {core})
    while True:
        pass


@contextmanager
def neighbour(core: int, count: int) -> Iterator[None]:
    """*count* processes spinning on *core* until the block ends (killed also on errors)."""
    procs = [
        multiprocessing.Process(target=_spin_on, args=(core,), daemon=True) for _ in range(count)
    ]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(timeout=10)


# --- the load ------------------------------------------------------------------------------


def arrivals(rate_req_s: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, duration_s), seconds."""
    rng = np.random.default_rng(seed)
    times, t = [], 0.0
    while True:
        t += float(rng.exponential(1.0 / rate_req_s))
        if t >= duration_s:
            return times
        times.append(t)


def prompts(count: int, words: tuple[int, int], seed: int) -> list[str]:
    """*count* prompts, each opening with its own number (no prefix shared past the chat
    template), of a uniform number of words in *words*."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in range(count):
        n = int(rng.integers(words[0], words[1] + 1))
        body = " ".join(WORDS[int(k)] for k in rng.integers(0, len(WORDS), n))
        out.append(f"Request {i}: {body}")
    return out


def summary(chats: Sequence[Chat], contract: dict[str, float]) -> dict[str, Any]:
    """What the chats add up to: counts, attainment over all sent and over those served as RT,
    TTFT / TPOT percentiles (seconds) of those served as RT."""
    served_rt = [c for c in chats if c.status == 200 and c.downgraded is None]
    met = sum(c.met(contract) for c in chats)
    ttfts = sorted(c.ttft_s for c in served_rt if c.ttft_s is not None)
    tpots = sorted(c.tpot_s for c in served_rt if c.tpot_s is not None)
    return {
        "sent": len(chats),
        "served_rt": len(served_rt),
        "refused": sum(c.status == 429 for c in chats),
        "downgraded": sum(c.downgraded is not None for c in chats),
        "failed": sum(c.status not in (200, 429) for c in chats),
        "met": met,
        "attainment": met / len(chats) if chats else None,
        "admitted_attainment": (
            sum(c.met(contract) for c in served_rt) / len(served_rt) if served_rt else None
        ),
        "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "tpot_p50_s": _percentile(tpots, 0.5),
        "tpot_p99_s": _percentile(tpots, 0.99),
    }


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted values (None for none)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def replica_row(stats: dict[str, Any]) -> dict[str, Any]:
    """What one replica's engine stats say: requests finished and the learned pace."""
    paces = [stats.get(f"latency_mean_pace_{regime}") for regime in ("decode", "prefill", "mixed")]
    known = [p for p in paces if isinstance(p, (int, float)) and p > 0]
    return {
        "finished": stats.get("finished"),
        "iterations": stats.get("iterations"),
        "busy_s": stats.get("busy_s"),
        "mean_pace": dict(zip(("decode", "prefill", "mixed"), paces, strict=True)),
        "mean_pace_geomean": (
            math.exp(sum(math.log(p) for p in known) / len(known)) if known else None
        ),
        "latency_error_p50": stats.get("latency_error_p50"),
    }


async def _load(
    base_url: str, token: str, options: Options, times: list[float], texts: list[str]
) -> list[Chat]:
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        gw = Gateway(base_url, token, session)
        key = await gw.tenant("chat", "rt", options.contract)
        t0 = time.perf_counter()

        async def one(at_s: float, text: str) -> Chat:
            await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - t0)))
            return await chat(session, base_url, key, options.chat_max_tokens, t0, prompt=text)

        return list(await asyncio.gather(*(one(t, p) for t, p in zip(times, texts, strict=True))))


async def follow_feedback(
    base_url: str, timeline: list[dict[str, Any]], stop: asyncio.Event, every_s: float = 0.5
) -> None:
    """Samples the SLO admission's TTFT correction (`tandem_slo_ttft_feedback_seconds`, by
    engine where the gateway labels it) from /metrics until *stop* is set."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.get(f"{base_url}/metrics") as resp:
                    text = await resp.text()
            except aiohttp.ClientError:
                text = ""
            values = {
                sample.labels.get("engine", "all"): sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "tandem_slo_ttft_feedback_seconds"
                for sample in family.samples
            }
            timeline.append({"t_s": round(time.perf_counter() - t0, 2), "extra_s": values})
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


async def _load_and_follow(
    base_url: str, token: str, options: Options, times: list[float], texts: list[str]
) -> tuple[list[Chat], list[dict[str, Any]]]:
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    follower = asyncio.create_task(follow_feedback(base_url, timeline, stop))
    try:
        chats = await _load(base_url, token, options, times, texts)
    finally:
        stop.set()
        await follower
    return chats, timeline


async def _both_serving(base_url: str, timeout_s: float) -> None:
    """Waits for /readyz to list two engines, both serving."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(f"{base_url}/readyz") as resp:
                engines = (await resp.json()).get("engines", [])
            if len(engines) == 2 and all(e["serving"] for e in engines):
                return
            await asyncio.sleep(1.0)
    raise RuntimeError(f"both replicas not serving after {timeout_s:.0f} s")


def run_router(router: str, out_dir: Path, options: Options) -> dict[str, Any]:
    """The load on a fresh two-replica `tandem serve` placing with *router*; its results."""
    workdir = out_dir / re.sub(r"[^A-Za-z0-9_.=-]+", "_", router)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tandem.db").unlink(missing_ok=True)
    cfg, port = config_for("tandem", workdir, NewUserOptions())
    engine_port = free_consecutive_ports(2)  # the pool's replicas take p and p + 1
    cfg["engine"].update(port=engine_port, replicas=2)
    cfg["gateway"]["router"] = router
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cores = two_cores()
    times = arrivals(options.rate_req_s, options.duration_s, options.seed)
    texts = prompts(len(times), options.prompt_words, options.seed)
    token = secrets.token_hex(16)
    say = lambda line: print(f"[{router}] {line}", file=sys.stderr)  # noqa: E731
    with served(config_path, token, workdir / "gateway.log", port) as base_url:
        asyncio.run(_both_serving(base_url, 600))
        ports = [engine_port, engine_port + 1]
        pinned = [
            pin_group(os.getpgid(engine_pid(p)), core) for p, core in zip(ports, cores, strict=True)
        ]
        say(f"serving; replica threads pinned to cores {cores}: {pinned}")
        started = time.monotonic()
        with neighbour(cores[SLOWED], options.burners):
            chats, feedback = asyncio.run(_load_and_follow(base_url, token, options, times, texts))
        load_s = time.monotonic() - started
        replicas = []
        for p in ports:
            status, stats = engine_control_get(p, CONTROL_STATS_PATH, 10.0)
            replicas.append(replica_row(stats) if status == 200 and isinstance(stats, dict) else {})
    steady = [c for c in chats if c.started_s >= options.warmup_s]
    result = {
        "router": router,
        "contract": options.contract,
        "load_s": round(load_s, 1),
        "all": summary(chats, options.contract),
        "steady": summary(steady, options.contract),
        "replicas": replicas,
        "slowed_replica": SLOWED,
        "ttft_feedback": feedback,
        "chats": [asdict(c) for c in chats],
    }
    say(f"all: {result['all']}")
    say(f"replicas: {replicas}")
    (workdir / "result.json").write_text(json.dumps(result, indent=2))
    return result


# --- the report ----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def report(results: list[dict[str, Any]], options: Options, command: str) -> str:
    """The run's table, markdown."""
    c = options.contract
    lines = [
        "# One of two real replicas slowed by a neighbour (issue 18, placement)",
        "",
        "```",
        command,
        "```",
        "",
        f"RT chats at {options.rate_req_s:g} req/s for {options.duration_s:g} s "
        f"({options.chat_max_tokens} tokens each), contract TTFT {c['ttft_ms']:g} ms / TPOT "
        f"{c['tpot_ms']:g} ms; replica {SLOWED} shares its core with {options.burners} "
        "spinning process(es). Steady: chats sent after the first "
        f"{options.warmup_s:g} s.",
        "",
        "| router | attainment | steady | admitted att. | refused | TTFT p50 | TTFT p99 | "
        "TPOT p50 | finished on replica 0 / 1 | learned pace 0 / 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, s = r["all"], r["steady"]
        reps = r["replicas"]
        finished = " / ".join(str(x.get("finished", "–")) for x in reps)
        pace = " / ".join(
            "–" if x.get("mean_pace_geomean") is None else f"{x['mean_pace_geomean']:.2f}"
            for x in reps
        )
        lines.append(
            f"| {r['router']} | {_share(a['attainment'])} | {_share(s['attainment'])} | "
            f"{_share(a['admitted_attainment'])} | {a['refused']}/{a['sent']} | "
            f"{_ms(a['ttft_p50_s'])} ms | {_ms(a['ttft_p99_s'])} ms | {_ms(a['tpot_p50_s'])} ms | "
            f"{finished} | {pace} |"
        )
    lines += [
        "",
        "Finished counts include the gateway's health probes. Learned pace: the geometric mean "
        "over batch kinds of the calibration's Σ measured ÷ Σ predicted over the run.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.studies.slow_replica", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--routers", default=",".join(Options.routers))
    parser.add_argument("--rate", type=float, default=Options.rate_req_s)
    parser.add_argument("--duration-s", type=float, default=Options.duration_s)
    parser.add_argument("--warmup-s", type=float, default=Options.warmup_s)
    parser.add_argument("--chat-max-tokens", type=int, default=Options.chat_max_tokens)
    parser.add_argument("--burners", type=int, default=Options.burners)
    parser.add_argument("--ttft-ms", type=float, default=300.0)
    parser.add_argument("--tpot-ms", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/slow_replica"))
    args = parser.parse_args(argv)
    routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        parser.error(f"unknown router {unknown[0]!r} (one of {', '.join(ROUTERS)})")
    if args.rate <= 0 or args.duration_s <= 0 or args.burners < 0:
        parser.error("--rate and --duration-s must be > 0, --burners ≥ 0")
    try:
        two_cores()
    except ValueError as exc:
        parser.error(str(exc))
    options = Options(
        routers=routers,
        rate_req_s=args.rate,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        chat_max_tokens=args.chat_max_tokens,
        burners=args.burners,
        contract={"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
        seed=args.seed,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_router(r, args.out, options) for r in routers]
    command = "python -m bench.studies.slow_replica " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    (args.out / "results.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "chats"} for r in results], indent=2)
    )
    text = report(results, options, command.strip())
    (args.out / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
