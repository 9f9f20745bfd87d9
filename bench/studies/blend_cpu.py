"""The batch runner's orderings on the real CPU engine: fcfs (file order) vs dfs vs blend.

    python -m bench.studies.blend_cpu [--requests 96] [--repeats 2] [--out FILE.json]
                              [--engine-url http://127.0.0.1:30000]

Without `--engine-url` it starts stock SGLang (tandem's patch off, so the engine schedules FCFS
and the order is ours) with the built-in tiny model on CPU, like `tandem serve`. A W4-like job
with real token ids: MMLU-like lines (24 subjects sharing a 384-token few-shot prefix, 2-token
answers), chat-like lines (unique prompts, short answers) and a few long-output lines. Each
ordering feeds the engine through the same `BatchFeed` as the gateway's runner (pilot first,
bounded in flight, KV budget = the engine's pool); the feed sees each line's output *cap* (its
class), never its true length. The prefix cache is flushed before every run, and the orderings
alternate, `--repeats` times, so machine noise hits them alike. Reports total tokens/s (prompt +
output over the makespan), makespan, and prefix reuse (cached prompt tokens / prompt tokens, as
the engine counts them), and — because wall time on a shared machine measures the neighbours
as much as the engine — tokens per CPU second the engine processes used (BlendServe likewise
counts only the accelerator's time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from backend.policy.batch_order.feed import ORDERINGS, BatchFeed, FeedSettings
from backend.policy.batch_order.tree import OrderItem

KV_TOKENS = 8192
MAX_RUNNING = 16
SUBJECTS = 24
PREFIX_TOKENS = 384
"""24 subjects × 384 shared tokens: more than the pool keeps cached next to the running lines,
so the order decides how often a prefix is computed again (W4's situation on an H100)."""


@dataclass(frozen=True)
class Line:
    """One request of the job."""

    input_ids: list[int]
    output_len: int
    """True output length (forced with ignore_eos)."""
    cap: int
    """The cap a client would send: what the feed sees."""


def make_job(n: int, seed: int = 0, vocab: int = 4096) -> list[Line]:
    """A W4-like job in random (file) order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(PREFIX_TOKENS)] for _ in range(SUBJECTS)]
    lines: list[Line] = []
    for _ in range(n):
        u = rng.random()
        if u < 0.35:  # MMLU-like: shared few-shot prefix, 2-token answer
            ids = rng.choice(prefixes) + [
                rng.randrange(10, vocab) for _ in range(rng.randint(32, 64))
            ]
            lines.append(Line(ids, 2, 2))
        elif u < 0.90:  # chat-like
            ids = [rng.randrange(10, vocab) for _ in range(rng.randint(64, 384))]
            lines.append(Line(ids, rng.randint(16, 48), 128))
        else:  # long output ("video-like")
            ids = [rng.randrange(10, vocab) for _ in range(rng.randint(32, 64))]
            lines.append(Line(ids, rng.randint(128, 256), 512))
    return lines


def engine_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) used so far by the engine process and its children (the
    scheduler runs the model). On a shared, busy machine this is the engine's own work, which
    wall time is not; None when the engine is not ours."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        proc = int(stat.parent.name)
        if proc == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


async def run_ordering(
    session: aiohttp.ClientSession,
    url: str,
    job: list[Line],
    ordering: str,
    engine_pid: int | None = None,
) -> dict[str, Any]:
    """Feeds the job in `ordering`; returns its measurements."""
    async with session.post(f"{url}/flush_cache") as resp:
        await resp.read()
    items = [
        OrderItem(
            index=i, path=line.input_ids, prompt_len=len(line.input_ids), max_output_len=line.cap
        )
        for i, line in enumerate(job)
    ]
    feed = BatchFeed(
        items,
        FeedSettings(
            ordering=ordering,  # type: ignore[arg-type]
            memory_tokens=KV_TOKENS,
            max_inflight=MAX_RUNNING,
            pilot_fraction=0.05,
            pilot_max_lines=8,
        ),
    )
    done = asyncio.Event()
    totals = {"prompt": 0, "cached": 0, "output": 0}
    running: set[asyncio.Task[None]] = set()

    async def one(index: int) -> None:
        line = job[index]
        body = {
            "input_ids": line.input_ids,
            "stream": False,
            "sampling_params": {
                "max_new_tokens": line.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
            },
        }
        async with session.post(f"{url}/generate", json=body) as resp:
            out = await resp.json()
        meta = out["meta_info"]
        totals["prompt"] += int(meta["prompt_tokens"])
        totals["cached"] += int(meta.get("cached_tokens", 0) or 0)
        totals["output"] += int(meta["completion_tokens"])
        feed.finished(index, int(meta["completion_tokens"]))
        fill()

    def fill() -> None:
        while (index := feed.next()) is not None:
            task = asyncio.create_task(one(index))
            running.add(task)
            task.add_done_callback(running.discard)
        if feed.exhausted and feed.in_flight == 0:
            done.set()

    started = time.perf_counter()
    cpu_before = engine_cpu_s(engine_pid)
    fill()
    await done.wait()
    makespan = time.perf_counter() - started
    cpu_after = engine_cpu_s(engine_pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    tokens = totals["prompt"] + totals["output"]
    return {
        "ordering": ordering,
        "makespan_s": makespan,
        "engine_cpu_s": cpu,
        "total_tok_per_engine_cpu_s": tokens / cpu if cpu else None,
        "total_tok_s": (totals["prompt"] + totals["output"]) / makespan,
        "output_tok_s": totals["output"] / makespan,
        "prefix_reuse_ratio": totals["cached"] / totals["prompt"] if totals["prompt"] else 0,
        "computed_prompt_tokens": totals["prompt"] - totals["cached"],
        **{f"{k}_tokens": v for k, v in totals.items()},
    }


async def measure(
    url: str, requests: int, repeats: int, engine_pid: int | None = None
) -> dict[str, Any]:
    job = make_job(requests)
    runs: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        await run_ordering(session, url, job[:8], "fcfs", engine_pid)  # warm-up
        for rep in range(repeats):
            for ordering in ORDERINGS:
                result = await run_ordering(session, url, job, ordering, engine_pid)
                result["repeat"] = rep
                runs.append(result)
                print(
                    f"{ordering:<6} rep {rep}: {result['total_tok_s']:.0f} tok/s, makespan "
                    f"{result['makespan_s']:.1f} s, engine CPU {result['engine_cpu_s']} s, "
                    f"prefix reuse {result['prefix_reuse_ratio']:.1%}",
                    file=sys.stderr,
                )
    summary: dict[str, Any] = {}
    for ordering in ORDERINGS:
        mine = [r for r in runs if r["ordering"] == ordering]
        keys = ["total_tok_s", "makespan_s", "prefix_reuse_ratio", "computed_prompt_tokens"]
        if all(r["engine_cpu_s"] for r in mine):
            keys += ["engine_cpu_s", "total_tok_per_engine_cpu_s"]
        summary[ordering] = {k: statistics.fmean(r[k] for r in mine) for k in keys}
        summary[ordering]["total_tok_s_median"] = statistics.median(r["total_tok_s"] for r in mine)
        summary[ordering]["total_tok_s_runs"] = [round(r["total_tok_s"], 1) for r in mine]
    fcfs = summary["fcfs"]["total_tok_s"]
    per_cpu = {o: summary[o].get("total_tok_per_engine_cpu_s") for o in ORDERINGS}
    dfs_reuse = summary["dfs"]["prefix_reuse_ratio"]
    return {
        "requests": requests,
        "repeats": repeats,
        "kv_tokens": KV_TOKENS,
        "max_inflight": MAX_RUNNING,
        "runs": runs,
        "mean": summary,
        "blend_vs_fcfs_throughput": summary["blend"]["total_tok_s"] / fcfs,
        "blend_vs_fcfs_throughput_median": summary["blend"]["total_tok_s_median"]
        / summary["fcfs"]["total_tok_s_median"],
        "blend_vs_fcfs_computed_prompt_tokens": summary["blend"]["computed_prompt_tokens"]
        / summary["fcfs"]["computed_prompt_tokens"],
        "dfs_vs_fcfs_throughput": summary["dfs"]["total_tok_s"] / fcfs,
        "blend_vs_fcfs_tok_per_engine_cpu_s": per_cpu["blend"] / per_cpu["fcfs"]
        if per_cpu["blend"] and per_cpu["fcfs"]
        else None,
        "dfs_vs_fcfs_tok_per_engine_cpu_s": per_cpu["dfs"] / per_cpu["fcfs"]
        if per_cpu["dfs"] and per_cpu["fcfs"]
        else None,
        "blend_reuse_vs_dfs": summary["blend"]["prefix_reuse_ratio"] / dfs_reuse
        if dfs_reuse
        else None,
    }


def _launch(workdir: Path) -> Any:
    from backend.launch.sglang import (
        EngineProcess,
        engine_base_url,
        engine_env,
        server_argv,
    )
    from backend.launch.tiny_model import ensure_tiny_model
    from common.config import EngineConfig

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    model = ensure_tiny_model(workdir / "model-cache")
    cfg = EngineConfig(
        port=port,
        patch=False,
        max_total_tokens=KV_TOKENS,
        max_running_requests=MAX_RUNNING,
        chunked_prefill_size=512,
    )
    engine = EngineProcess(
        server_argv(cfg, model, "tandem-tiny", random_weights=True),
        engine_env(cfg),
        base_url=engine_base_url(cfg),
        log_path=str(workdir / "engine.log"),
    )
    engine.start()
    engine.wait_ready_sync(300)
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.blend_cpu", description=__doc__)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-url", help="a running engine (default: start one)")
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    args = parser.parse_args(argv)
    engine = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.engine_url is None:
            engine = _launch(Path(tmp))
        url = args.engine_url if engine is None else str(engine.base_url)
        try:
            result = asyncio.run(
                measure(url, args.requests, args.repeats, None if engine is None else engine.pid)
            )
        finally:
            if engine is not None:
                engine.stop()
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
