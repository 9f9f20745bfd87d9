"""`tandem profile`: measures a running engine's iteration latency through its HTTP API only.

    tandem profile --out bench/profiles/NAME.json [--url URL | --config FILE] [--quick]
    python -m bench.profiler --launch --out bench/profiles/cpu-tiny.json   # starts its own engine
    tandem profile --report bench/profiles/*.json      # held-out MAPE and weights, no measuring

Black-box method (the engine is never instrumented; prompts are random token ids below the
model's vocabulary size, fresh for every request, and the prefix cache is flushed between
probes, so nothing is served from cache unless a probe asks for it):

* **Round trip** — one request with a 1-token prompt on an idle engine: the HTTP, tokenizer-
  manager and detokenizer time is its TTFT minus its own steady inter-token gap (a 1-token
  prefill iteration costs what a 1-token decode iteration costs).
* **Decode only** — B concurrent requests with C-token prompts, ``ignore_eos``: once every
  stream is decoding, the median per-token gap over the next `decode_steps` tokens is the time
  of an iteration of B decodes at context ≈ C + k  → shape (num_decode=B, decode_context=B·(C+k)).
* **Mixed** — while those B streams decode, a prefill of P tokens (max_new_tokens=1) is sent;
  the decode streams' gap that ends with the prefill's first token is the time of the mixed
  iteration → shape (P prefill + B decodes). The engine counts running decodes against its chunk
  budget (SGLang's mixed chunk), so only P + B ≤ chunked_prefill_size is probed: one iteration.
* **Prefill only** — one request of P tokens (P ≤ chunked_prefill_size: one iteration) with
  max_new_tokens=1 on an idle engine: TTFT minus the round trip. With a prefix, a request of
  the prefix tokens runs first, so the probe's prefix is served from the cache and the
  iteration prefills P tokens attending to it (the engine's ``cached_tokens`` says how many).

Every point is measured `repeats` times (fresh requests) and the median kept. Module limits:
the engine's KV pool, batch size and chunk size bound the grid; points outside are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from backend.policy.latency import BatchShape, Profile, ProfileSample
from bench.profiles.probe import (
    EngineFacts,
    Prober,
    ProfilerError,
    Stream,
    client_session,
    discover,
)

Progress = Callable[[str], None]
WARMUP_TOKENS = 3  # decode tokens skipped before the steady window (all streams decoding)
KV_HEADROOM = 0.9  # use at most this share of the KV pool, so no request is ever retracted
WAIT_S = 300.0  # longest wait for any one probe


@dataclass(frozen=True)
class ProfileGrid:
    """Which shapes to measure (tokens and requests); infeasible points are skipped."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """B: concurrent decoding requests."""
    decode_contexts: tuple[int, ...] = (32, 256, 1024)
    """C: prompt tokens of each decoding request."""
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 384, 512)
    """P: prefill-only chunk sizes (capped at the engine's chunked_prefill_size)."""
    prefill_prefixes: tuple[int, ...] = (0, 1024, 3072)
    """Cached prefix the prefill-only chunk attends to."""
    mixed_prefill_tokens: tuple[int, ...] = (64, 256)
    """P: prefills injected into every decode probe (mixed iterations); () for none."""
    repeats: int = 3
    """Measurements per point; the median is kept."""
    decode_steps: int = 16
    """Decode tokens per steady window."""
    seed: int = 0
    """Seed of the random prompts."""

    @classmethod
    def quick(cls) -> ProfileGrid:
        """A small grid (about 20 s on the CPU tiny engine) for tests and smoke runs."""
        return cls(decode_batches=(1, 8), decode_contexts=(32, 512), prefill_tokens=(16, 256, 512),
                   prefill_prefixes=(0, 1024), mixed_prefill_tokens=(128,), repeats=1,
                   decode_steps=8)


async def profile_engine(base_url: str, *, grid: ProfileGrid, name: str,
                         progress: Progress | None = None, vocab_size: int | None = None,
                         command: str | None = None) -> Profile:
    """Measures the engine at *base_url* over *grid* and returns the profile (not saved).

    *vocab_size* overrides what the engine reports; *command* goes into the description.
    Raises ProfilerError (one line) when the engine is unreachable or refuses a probe."""
    say = progress or (lambda _line: None)
    base_url = base_url.rstrip("/")
    started = time.monotonic()
    async with client_session() as session:
        facts = await discover(session, base_url, vocab_size)
        prober = Prober(session, base_url, facts, grid.seed)
        await prober.settle()
        busy = await _cpu_busy_share()
        if busy is not None and busy > 0.15:
            say(f"warning: the CPUs are {busy:.0%} busy with the engine idle: other work on "
                "this machine distorts the timings")
        rtt = await _round_trip(prober, grid)
        say(f"engine {base_url}: {_facts_line(facts)}; round trip {rtt * 1e3:.1f} ms")
        samples = await _prefill_points(prober, grid, rtt, say)
        samples += await _decode_points(prober, grid, say)
        await prober.settle()
    elapsed = time.monotonic() - started
    return Profile(
        name=name,
        description=_description(base_url, grid, facts, rtt, elapsed, command, busy),
        model=facts.model,
        hardware=_machine(),
        kv_capacity_tokens=facts.kv_capacity_tokens,
        page_size=facts.page_size,
        max_prefill_tokens=facts.chunked_prefill_size,
        host_copy_gb_s=None,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        samples=samples,
    )


async def _round_trip(prober: Prober, grid: ProfileGrid) -> float:
    """Median over repeats of (TTFT − steady gap) of a 1-token prompt, seconds."""
    values = []
    for _ in range(max(3, grid.repeats)):
        stream, task = prober.start(prober.random_prompt(1), WARMUP_TOKENS + 8)
        await prober.wait_until(_is_done(stream), WAIT_S, "the round-trip probe")
        _check(task, [stream], WARMUP_TOKENS + 8)
        gap = _steady_gap([stream], 1, stream.tokens)
        values.append(max(0.0, stream.ttft_s - gap))
    await prober.settle()
    return statistics.median(values)


async def _prefill_points(prober: Prober, grid: ProfileGrid, rtt: float, say: Progress
                          ) -> list[ProfileSample]:
    facts = prober.facts
    samples = []
    for prefix in grid.prefill_prefixes:
        for tokens in grid.prefill_tokens:
            if tokens > facts.chunked_prefill_size or not _fits(facts, prefix + tokens + 1):
                say(f"skip prefill {tokens} after {prefix}: beyond the engine's limits")
                continue
            runs = [await _prefill_once(prober, tokens, prefix, rtt)
                    for _ in range(grid.repeats)]
            shape, seconds = _median_run(runs)
            samples.append(ProfileSample(shape=shape, seconds=seconds))
            say(f"prefill {shape.prefill_tokens:5d} after {prefix:5d}: {seconds * 1e3:7.2f} ms")
    return samples


async def _prefill_once(prober: Prober, tokens: int, prefix: int, rtt: float
                        ) -> tuple[BatchShape, float]:
    await prober.settle()
    prompt: list[int] = []
    if prefix:  # run the prefix once so the probe finds it in the prefix cache
        prompt = prober.random_prompt(prefix)
        setup, task = prober.start(prompt, 1)
        await prober.wait_until(lambda: setup.is_done, WAIT_S, "the prefix request")
        _check(task, [setup], 1)
    stream, task = prober.start(prompt + prober.random_prompt(tokens), 1)
    await prober.wait_until(lambda: stream.is_done, WAIT_S, "a prefill probe")
    _check(task, [stream], 1)
    cached = min(stream.cached_tokens, stream.prompt_len - 1)
    shape = BatchShape().with_prefill(stream.prompt_len - cached, cached)
    return shape, max(1e-5, stream.ttft_s - rtt)


async def _decode_points(prober: Prober, grid: ProfileGrid, say: Progress
                         ) -> list[ProfileSample]:
    facts = prober.facts
    samples = []
    for batch in grid.decode_batches:
        for context in grid.decode_contexts:
            limit = facts.chunked_prefill_size - batch  # decodes share the chunk budget
            mixed = [p for p in grid.mixed_prefill_tokens if p <= limit]
            # Slack: each mixed probe lets the decodes run on for its round trip (aborted after).
            max_new = WARMUP_TOKENS + grid.decode_steps + 24 * len(mixed) + 32
            if batch > facts.max_running_requests or not _fits(
                    facts, batch * (context + max_new) + max(mixed, default=0), context + max_new):
                say(f"skip decode {batch} x {context}: beyond the engine's limits")
                continue
            runs = [await _decode_session(prober, grid, batch, context, mixed, max_new)
                    for _ in range(grid.repeats)]
            for point in zip(*runs, strict=True):  # the decode sample, then one per mixed P
                shape, seconds = _median_run(list(point))
                samples.append(ProfileSample(shape=shape, seconds=seconds))
            say(f"decode {batch:3d} x {context:5d}: "
                + ", ".join(f"{s.seconds * 1e3:.2f} ms" for s in samples[-len(runs[0]):]))
    return samples


async def _decode_session(prober: Prober, grid: ProfileGrid, batch: int, context: int,
                          mixed: Sequence[int], max_new: int) -> list[tuple[BatchShape, float]]:
    """One run of B decode streams: the steady decode point, then one mixed point per P."""
    await prober.settle()
    started = [prober.start(prober.random_prompt(context), max_new) for _ in range(batch)]
    streams = [s for s, _ in started]
    tasks = [t for _, t in started]
    end = WARMUP_TOKENS + grid.decode_steps
    try:
        await prober.wait_until(lambda: all(s.tokens >= end or s.is_done for s in streams),
                                WAIT_S, f"{batch} decode streams")
        for task in tasks:
            _check(task, streams, end, still_running=True)
        gap = _steady_gap(streams, WARMUP_TOKENS, end)
        mean_ctx = context + (WARMUP_TOKENS + end) // 2
        points = [(BatchShape(decode_context=batch * mean_ctx, num_decode=batch), gap)]
        for tokens in mixed:
            points.append(await _mixed_once(prober, streams, tasks, tokens, context))
        return points
    finally:
        await prober.abort(streams, tasks)


async def _mixed_once(prober: Prober, streams: list[Stream], tasks: list[asyncio.Task[None]],
                      tokens: int, context: int) -> tuple[BatchShape, float]:
    """Injects a P-token prefill into running decodes; the decode gap around its first token."""
    probe, task = prober.start(prober.random_prompt(tokens), 1)
    await prober.wait_until(lambda: probe.is_done, WAIT_S, "a mixed prefill probe")
    _check(task, [probe], 1)
    t_mixed = probe.arrivals[0][0]
    await prober.wait_until(
        lambda: all(sum(t > t_mixed for t, _ in s.arrivals) >= 2 or s.is_done for s in streams),
        WAIT_S, "decodes after a mixed prefill")
    gaps, contexts = [], []
    for stream in streams:
        arrivals = stream.arrivals
        i = min(range(len(arrivals)), key=lambda j: abs(arrivals[j][0] - t_mixed))
        if i > 0 and arrivals[i][1] - arrivals[i - 1][1] == 1:  # one iteration, one token
            gaps.append(arrivals[i][0] - arrivals[i - 1][0])
            contexts.append(context + arrivals[i - 1][1])
    if not gaps or any(s.is_done for s in streams):
        raise ProfilerError("decode streams ended during a mixed probe (engine aborted them?)")
    cached = min(probe.cached_tokens, probe.prompt_len - 1)
    shape = BatchShape(decode_context=sum(contexts) * len(streams) // len(contexts),
                       num_decode=len(streams)).with_prefill(probe.prompt_len - cached, cached)
    return shape, statistics.median(gaps)


def _is_done(stream: Stream) -> Callable[[], bool]:
    return lambda: stream.is_done


def _steady_gap(streams: Sequence[Stream], first_token: int, last_token: int) -> float:
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


def _median_run(runs: list[tuple[BatchShape, float]]) -> tuple[BatchShape, float]:
    """The run with the median time (its own shape, so shape and time stay paired)."""
    ordered = sorted(runs, key=lambda run: run[1])
    return ordered[(len(ordered) - 1) // 2]


def _fits(facts: EngineFacts, kv_tokens: int, seq_len: int = 0) -> bool:
    """True when *kv_tokens* fit the pool with headroom and *seq_len* fits the context."""
    if facts.kv_capacity_tokens and kv_tokens > KV_HEADROOM * facts.kv_capacity_tokens:
        return False
    return facts.context_length is None or max(seq_len, 0) <= facts.context_length


def _check(task: asyncio.Task[None], streams: Sequence[Stream], tokens: int,
           still_running: bool = False) -> None:
    """Raises the stream task's error, or ProfilerError when a stream fell short."""
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
    if any(s.tokens < tokens for s in streams):
        what = "ended early" if not still_running else "stopped before the window ended"
        raise ProfilerError(f"a probe stream {what} ({min(s.tokens for s in streams)} of "
                            f"{tokens} tokens): is the KV pool too small for the grid?")


def _facts_line(facts: EngineFacts) -> str:
    return (f"vocab {facts.vocab_size}, KV {facts.kv_capacity_tokens} tokens, chunk "
            f"{facts.chunked_prefill_size}, batch ≤ {facts.max_running_requests}")


async def _cpu_busy_share(window_s: float = 1.0) -> float | None:
    """Share of all CPUs busy over *window_s* (Linux /proc/stat), None elsewhere."""
    def idle_total() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    try:
        idle0, total0 = idle_total()
        await asyncio.sleep(window_s)
        idle1, total1 = idle_total()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def _machine() -> dict[str, Any]:
    """Facts about this machine (the engine's, when the profiler runs beside it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"device": "cpu", "cpu": cpu, "cpu_count": os.cpu_count(),
            "platform": platform.platform()}


def _description(base_url: str, grid: ProfileGrid, facts: EngineFacts, rtt: float,
                 elapsed: float, command: str | None, busy: float | None) -> str:
    machine = _machine()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Measured by `{command or 'tandem profile'}` against {base_url} on {date} in "
        f"{elapsed:.0f} s; machine: {machine['cpu_count']}-core {machine['device'].upper()} "
        f"({machine['cpu']}), {'?' if busy is None else f'{busy:.0%}'} busy before it "
        f"started (engine idle). Black box over HTTP (bench/profiler.py): decode-only = median "
        f"inter-token gap of B concurrent streams; mixed = decode gap containing an injected "
        f"prefill's first token; prefill-only = TTFT minus the round trip ({rtt * 1e3:.1f} ms: "
        f"TTFT of a 1-token prompt minus its decode gap); median of {grid.repeats} runs per "
        f"point. Engine: {_facts_line(facts)}. Grid: {asdict(grid)}."
    )


# ---------------------------------------------------------------------- command line


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `profile` to a `tandem` sub-command parser (argparse's add_subparsers result)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "profile", help="measure the engine's iteration latency, write a profile",
        description="Measures a running engine's iteration latency over a grid of batch "
                    "shapes (HTTP only) and writes the profile the latency model and the "
                    "simulator use.")
    from bench.profiles.cli import add_arguments, run_profile_command

    add_arguments(parser)
    parser.set_defaults(func=run_profile_command)
    return parser


def grid_from_args(args: argparse.Namespace) -> ProfileGrid:
    """The grid `--quick` and the grid options describe."""
    grid = ProfileGrid.quick() if args.quick else ProfileGrid()
    overrides: dict[str, Any] = {}
    for key in ("decode_batches", "decode_contexts", "prefill_tokens", "prefill_prefixes",
                "mixed_prefill_tokens"):
        if getattr(args, key, None) is not None:
            overrides[key] = tuple(getattr(args, key))
    for key in ("repeats", "decode_steps", "seed"):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    return replace(grid, **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.profiler ...`: the same options as `tandem profile`."""
    parser = argparse.ArgumentParser(prog="python -m bench.profiler")
    add_profile_parser(parser.add_subparsers(dest="command"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["profile", *argv])
    args.command_line = shlex.join(["python", "-m", "bench.profiler", *argv])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
