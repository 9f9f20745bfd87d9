"""`tandem profile`: measures a running engine's iteration latency through its HTTP API only.

    tandem profile --out backend/policy/profiles/NAME.json [--url URL | --config FILE] [--quick]
    tandem profile --launch --out backend/policy/profiles/cpu-tiny.json  # starts its own engine
    tandem profile --report backend/policy/profiles/*.json   # held-out MAPE, weights; no measuring

Black-box method (the engine is never instrumented; prompts are random token ids below the
model's vocabulary size, fresh for every request, and the prefix cache is flushed between
probes, so nothing is served from cache unless a probe asks for it):

* **Round trip** — a 1-token prompt on an idle engine: the HTTP, tokenizer-manager and
  detokenizer time is its TTFT minus its one prefill step. The step is the engine's own figure
  when it reports one (SGLang's cumulative prefill time on ``/v1/loads``), else the prompt's
  steady decode gap (on the CPU engine ~6 ms short of a 1-token prefill step).
* **Decode only** — B concurrent requests with C-token prompts, ``ignore_eos``: once every
  stream is decoding, the median per-token gap over the next `decode_steps` tokens is the time
  of an iteration of B decodes at context ≈ C + k  → shape (num_decode=B, decode_context=B·(C+k)).
* **Mixed** — while those B streams decode, a prefill of P tokens (max_new_tokens=1) is sent;
  the decode streams' gap of the iteration that ran it (see :func:`_mixed_once`) → shape
  (P prefill + B decodes). SGLang counts running decodes against its chunk budget (mixed
  chunk), so only P + B ≤ chunked_prefill_size is probed: one iteration.
* **Prefill only** — one request of P tokens (P ≤ chunked_prefill_size: one iteration) with
  max_new_tokens=1 on an idle engine: TTFT minus the round trip, and never less than the
  engine's own prefill step time when it reports one (``/v1/loads``). With a prefix, a request of
  the prefix tokens runs first, so the probe's prefix is served from the cache and the
  iteration prefills P tokens attending to it (the engine's ``cached_tokens`` says how many).

Every point is measured `repeats` times (fresh requests; more, up to 2·repeats + 1, until
`repeats` runs lie within ±15 % of their median) and the median run kept. The engine's KV pool,
batch size, chunk size and context bound the grid; points outside are skipped.
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import TypeVar

from backend.policy.latency import BatchShape, Profile, ProfileSample
from bench.profiler.machine import QuietGate, cpu_busy_share, machine_facts
from bench.profiler.probe import (
    EngineFacts,
    Prober,
    ProfilerError,
    Stream,
    client_session,
    discover,
    median_run,
    repeat_until_stable,
    steady_gap,
)

Progress = Callable[[str], None]
T = TypeVar("T")
WARMUP_TOKENS = 3  # decode tokens skipped before the steady window (all streams decoding)
KV_HEADROOM = 0.9  # use at most this share of the KV pool, so no request is ever retracted
WAIT_S = 300.0  # longest wait for any one probe
MIXED_TOLERANCE_S = 0.002  # decode chunks of the mixed iteration may trail its prefill's token


@dataclass(frozen=True)
class ProfileGrid:
    """Which shapes to measure (tokens and requests); infeasible points are skipped."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """B: concurrent decoding requests."""
    decode_contexts: tuple[int, ...] = (32, 256, 1024, 2048)
    """C: prompt tokens of each decoding request."""
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 384, 512)
    """P: prefill-only chunk sizes (capped at the engine's chunked_prefill_size)."""
    prefill_prefixes: tuple[int, ...] = (0, 512, 1536)
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
        return cls(
            decode_batches=(1, 8),
            decode_contexts=(32, 512),
            prefill_tokens=(16, 256, 512),
            prefill_prefixes=(0, 1024),
            mixed_prefill_tokens=(128,),
            repeats=1,
            decode_steps=8,
        )


async def profile_engine(
    base_url: str,
    *,
    grid: ProfileGrid,
    name: str,
    progress: Progress | None = None,
    vocab_size: int | None = None,
    command: str | None = None,
    quiet_wait_s: float = 0.0,
    headers: Mapping[str, str] | None = None,
) -> Profile:
    """Measures the engine at *base_url* over *grid* and returns the profile (not saved).

    *vocab_size* overrides what the engine reports; *command* goes into the description.
    *quiet_wait_s*: before each probe, wait up to this long for this machine's CPUs to be idle
    (an engine on a machine shared with other work; 0: never wait). *headers* go with every
    request (the engine's API key).
    Raises ProfilerError (one line) when the engine is unreachable or refuses a probe."""
    say = progress or (lambda _line: None)
    base_url = base_url.rstrip("/")
    started = time.monotonic()
    gate = QuietGate(quiet_wait_s)
    async with client_session(headers) as session:
        facts = await discover(session, base_url, vocab_size)
        prober = Prober(session, base_url, facts, grid.seed)
        await prober.settle()
        busy = await cpu_busy_share()
        if busy is not None and busy > QuietGate.threshold:
            say(
                f"warning: the CPUs are {busy:.0%} busy with the engine idle: other work on "
                "this machine distorts the timings"
            )
        if quiet_wait_s > 0:
            prober.before_probe = gate.wait
        await _warm_up(prober)
        rtt, rtt_source = await _round_trip(prober, grid)
        say(
            f"engine {base_url}: {_facts_line(facts)}; round trip {rtt * 1e3:.1f} ms "
            f"(1-token TTFT minus its {rtt_source})"
        )
        samples = await _prefill_points(prober, grid, rtt, say)
        samples += await _decode_points(prober, grid, say)
        await prober.settle()
    elapsed = time.monotonic() - started
    return Profile(
        name=name,
        description=_description(base_url, grid, facts, (rtt, rtt_source), elapsed, command, gate),
        model=facts.model,
        hardware={**machine_facts(), "http_round_trip_ms": round(rtt * 1e3, 2)},
        kv_capacity_tokens=facts.kv_capacity_tokens,
        page_size=facts.page_size,
        max_prefill_tokens=facts.chunked_prefill_size,
        host_copy_gb_s=None,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        samples=samples,
    )


async def _warm_up(prober: Prober) -> None:
    """Runs every code path once (chunked prefill, prefix hit, batched decode) and discards
    the timings: the first iterations of a fresh engine are slower."""
    prompt = prober.random_prompt(prober.facts.chunked_prefill_size + 64)
    started = [prober.start(prompt, 8), prober.start(prober.random_prompt(64), 8)]
    await prober.wait_until(lambda: all(s.is_done for s, _ in started), WAIT_S, "warm-up")
    later = [prober.start(prompt + prober.random_prompt(16), 4)]
    await prober.wait_until(lambda: all(s.is_done for s, _ in later), WAIT_S, "warm-up")
    for stream, task in started + later:
        _check(task, [stream], 1)
    await prober.settle()


async def _round_trip(prober: Prober, grid: ProfileGrid) -> tuple[float, str]:
    """The HTTP + tokenizer-manager + detokenizer time of a request, seconds, and how it was
    calibrated: the median over runs of a 1-token prompt's TTFT minus its one prefill step.

    The step is the engine's own figure when it reports one (SGLang's cumulative prefill time
    on /v1/loads); otherwise the prompt's steady decode gap stands in for it. On the CPU
    engine a 1-token prefill step takes ~6 ms longer than a 1-request decode step, so the
    fallback makes every prefill-only point ~6 ms too long."""
    values, sources = [], []
    for _ in range(max(5, grid.repeats)):
        busy0 = await prober.prefill_busy_s()
        stream, task = prober.start(prober.random_prompt(1), WARMUP_TOKENS + 8)
        await prober.wait_until(_is_done(stream), WAIT_S, "the round-trip probe")
        _check(task, [stream], WARMUP_TOKENS + 8)
        busy1 = await prober.prefill_busy_s()
        if busy0 is not None and busy1 is not None and busy1 > busy0:
            step, source = busy1 - busy0, "engine-reported prefill step"
        else:
            step, source = steady_gap([stream], 1, stream.tokens), "decode gap"
        values.append(max(0.0, stream.ttft_s - step))
        sources.append(source)
        await prober.settle()
    return statistics.median(values), max(set(sources), key=sources.count)


async def _prefill_points(
    prober: Prober, grid: ProfileGrid, rtt: float, say: Progress
) -> list[ProfileSample]:
    facts = prober.facts
    samples = []
    for prefix in grid.prefill_prefixes:
        for tokens in grid.prefill_tokens:
            if tokens > facts.chunked_prefill_size or not _fits(facts, prefix + tokens + 1):
                say(f"skip prefill {tokens} after {prefix}: beyond the engine's limits")
                continue
            runs = await repeat_until_stable(
                partial(_prefill_once, prober, tokens, prefix, rtt), grid.repeats, _run_seconds
            )
            shape, seconds = median_run(runs)
            samples.append(ProfileSample(shape=shape, seconds=seconds))
            say(f"prefill {shape.prefill_tokens:5d} after {prefix:5d}: {seconds * 1e3:7.2f} ms")
    return samples


async def _prefill_once(
    prober: Prober, tokens: int, prefix: int, rtt: float
) -> tuple[BatchShape, float]:
    await prober.settle()
    prompt: list[int] = []
    if prefix:  # run the prefix once so the probe finds it in the prefix cache
        prompt = prober.random_prompt(prefix)
        setup, task = prober.start(prompt, 1)
        await prober.wait_until(lambda: setup.is_done, WAIT_S, "the prefix request")
        _check(task, [setup], 1)
    busy0 = await prober.prefill_busy_s()
    stream, task = prober.start(prompt + prober.random_prompt(tokens), 1)
    await prober.wait_until(lambda: stream.is_done, WAIT_S, "a prefill probe")
    _check(task, [stream], 1)
    busy1 = await prober.prefill_busy_s()
    cached = min(stream.cached_tokens, stream.prompt_len - 1)
    shape = BatchShape().with_prefill(stream.prompt_len - cached, cached)
    # The engine's own prefill step time bounds the point from below: a round trip
    # overestimated on a busy host once left a 16-token prefill 10 µs (TTFT − rtt clamped), and
    # that one point, weighed by its relative error, made the whole fit predict ~0.
    step = busy1 - busy0 if busy0 is not None and busy1 is not None and busy1 > busy0 else 0.0
    return shape, max(1e-5, step, stream.ttft_s - rtt)


async def _decode_points(prober: Prober, grid: ProfileGrid, say: Progress) -> list[ProfileSample]:
    facts = prober.facts
    samples = []
    for batch in grid.decode_batches:
        for context in grid.decode_contexts:
            limit = facts.chunked_prefill_size - batch  # decodes share the chunk budget
            mixed = [p for p in grid.mixed_prefill_tokens if p <= limit]
            # Slack: each mixed probe lets the decodes run on for its round trip (aborted after,
            # so slack costs nothing); on a loaded 2-core CI machine a probe's round trip was
            # seen to take 50+ decode steps, so the slack is generous — and when the decodes
            # still run out during a probe (a machine so busy that a 16-token prefill took
            # 0.6 s), the point is measured again with 4× the slack, up to SLACK_TRIES times.
            slack = 96 * len(mixed) + 64
            runs = None
            for _ in range(SLACK_TRIES):
                max_new = WARMUP_TOKENS + grid.decode_steps + slack
                if batch > facts.max_running_requests or not _fits(
                    facts, batch * (context + max_new) + max(mixed, default=0), context + max_new
                ):
                    break
                try:
                    runs = await repeat_until_stable(
                        partial(_decode_session, prober, grid, batch, context, mixed, max_new),
                        grid.repeats,
                        lambda points: _run_seconds(points[0]),
                    )
                    break
                except _RanOutOfTokens as exc:
                    slack *= 4
                    say(f"decode {batch} x {context}: {exc}; again with {slack} tokens of slack")
            if runs is None:
                say(f"skip decode {batch} x {context}: beyond the engine's limits")
                continue
            for point in zip(*runs, strict=True):  # the decode sample, then one per mixed P
                shape, seconds = median_run(list(point))
                samples.append(ProfileSample(shape=shape, seconds=seconds))
            say(
                f"decode {batch:3d} x {context:5d}: "
                + ", ".join(f"{s.seconds * 1e3:.2f} ms" for s in samples[-len(runs[0]) :])
            )
    return samples


SLACK_TRIES = 3
"""How many times a decode point is measured, each time with 4× the slack, when its decode
streams run out of tokens during a mixed probe."""


MIXED_TRIES = 3
"""How many mixed probes are sent, one after the other, for one mixed point while no decode
gap around the probe can be read."""


class _NoReadableGap(ProfilerError):
    """No decode stream had one token per chunk around the mixed probe: a machine busy enough
    sends a stream's tokens several to a chunk (the detokenizer or the client fell behind), and
    no iteration's time can be read off them."""


class _RanOutOfTokens(ProfilerError):
    """The decode streams generated every token they asked for before a mixed probe was read
    (the machine ran the probe far slower than their slack allowed)."""


async def _decode_session(
    prober: Prober, grid: ProfileGrid, batch: int, context: int, mixed: Sequence[int], max_new: int
) -> list[tuple[BatchShape, float]]:
    """One run of B decode streams: the steady decode point, then one mixed point per P."""
    await prober.settle()
    started = [prober.start(prober.random_prompt(context), max_new) for _ in range(batch)]
    streams = [s for s, _ in started]
    tasks = [t for _, t in started]
    end = WARMUP_TOKENS + grid.decode_steps
    try:
        await prober.wait_until(
            lambda: all(s.tokens >= end or s.is_done for s in streams),
            WAIT_S,
            f"{batch} decode streams",
        )
        for task in tasks:
            _check(task, streams, end, still_running=True)
        gap = steady_gap(streams, WARMUP_TOKENS, end)
        mean_ctx = context + (WARMUP_TOKENS + end) // 2
        points = [(_decodes(BatchShape(), [mean_ctx] * batch), gap)]
        for tokens in mixed:
            points.append(await _mixed_point(prober, streams, tokens, context, max_new))
        return points
    finally:
        await prober.abort(streams, tasks)


async def _mixed_point(
    prober: Prober, streams: list[Stream], tokens: int, context: int, max_new: int
) -> tuple[BatchShape, float]:
    """`_mixed_once`, probed again (up to `MIXED_TRIES` times) while no gap can be read: on a
    loaded 2-core machine the decodes' tokens arrived two to a chunk around a probe, and the
    profile failed as if the engine had aborted them."""
    for _ in range(MIXED_TRIES - 1):
        try:
            return await _mixed_once(prober, streams, tokens, context, max_new)
        except _NoReadableGap:
            pass  # the decodes run on: probe again
    return await _mixed_once(prober, streams, tokens, context, max_new)


async def _mixed_once(
    prober: Prober, streams: list[Stream], tokens: int, context: int, max_new: int
) -> tuple[BatchShape, float]:
    """Injects a P-token prefill into running decodes; the decode gap of the iteration that
    ran it.

    Which decode chunk closes that iteration depends on the engine: SGLang on CPU streams the
    prefill's first token with the *next* iteration's decode chunks (8-14 ms after the mixed
    iteration's, measured), an engine may also send both together. Both candidates are read —
    the gap closing at or just before the first token, and the one closing before that — and
    the longer one is the mixed iteration (it does strictly more work than a plain decode)."""
    probe, task = prober.start(prober.random_prompt(tokens), 1)
    await prober.wait_until(lambda: probe.is_done, WAIT_S, "a mixed prefill probe")
    _check(task, [probe], 1)
    t_first = probe.arrivals[0][0]
    await prober.wait_until(
        lambda: all(
            any(t > t_first + MIXED_TOLERANCE_S for t, _ in s.arrivals) or s.is_done
            for s in streams
        ),
        WAIT_S,
        "decodes after a mixed prefill",
    )
    gaps, contexts = [], []
    for stream in streams:
        arr = stream.arrivals
        last = max(j for j in range(len(arr)) if arr[j][0] <= t_first + MIXED_TOLERANCE_S)
        candidates = [
            (arr[i][0] - arr[i - 1][0], i)
            for i in (last, last - 1)
            if i > 0 and arr[i][0] > probe.sent_at and arr[i][1] - arr[i - 1][1] == 1
        ]
        if candidates:  # one iteration per chunk, ending after the prefill was sent
            gap, i = max(candidates)
            gaps.append(gap)
            contexts.append(context + arr[i - 1][1])
    if any(s.is_done and s.tokens >= max_new for s in streams):
        raise _RanOutOfTokens("the decode streams ran out of tokens during a mixed probe")
    if any(s.is_done for s in streams):
        raise ProfilerError("decode streams ended during a mixed probe (engine aborted them?)")
    if not gaps:
        raise _NoReadableGap(
            f"no decode gap readable around a {tokens}-token mixed probe in {MIXED_TRIES} tries: "
            "the decode streams' tokens came several to a chunk (a machine too busy to profile?)"
        )
    cached = min(probe.cached_tokens, probe.prompt_len - 1)
    typical = statistics.median_low(contexts)  # for streams whose gap was not readable
    contexts += [typical] * (len(streams) - len(contexts))
    shape = _decodes(BatchShape(), contexts).with_prefill(probe.prompt_len - cached, cached)
    return shape, statistics.median(gaps)


def _decodes(shape: BatchShape, contexts: Sequence[int]) -> BatchShape:
    """*shape* plus one decode per context."""
    for context in contexts:
        shape = shape.with_decode(context)
    return shape


def _run_seconds(run: tuple[BatchShape, float]) -> float:
    return run[1]


def _is_done(stream: Stream) -> Callable[[], bool]:
    return lambda: stream.is_done


def _fits(facts: EngineFacts, kv_tokens: int, seq_len: int = 0) -> bool:
    """True when *kv_tokens* fit the pool with headroom and *seq_len* fits the context."""
    if facts.kv_capacity_tokens and kv_tokens > KV_HEADROOM * facts.kv_capacity_tokens:
        return False
    return facts.context_length is None or max(seq_len, 0) <= facts.context_length


def _check(
    task: asyncio.Task[None], streams: Sequence[Stream], tokens: int, still_running: bool = False
) -> None:
    """Raises the stream task's error, or ProfilerError when a stream fell short."""
    if task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]
    if any(s.tokens < tokens for s in streams):
        what = "ended early" if not still_running else "stopped before the window ended"
        raise ProfilerError(
            f"a probe stream {what} ({min(s.tokens for s in streams)} of "
            f"{tokens} tokens): is the KV pool too small for the grid?"
        )


def _facts_line(facts: EngineFacts) -> str:
    return (
        f"vocab {facts.vocab_size}, KV {facts.kv_capacity_tokens} tokens, chunk "
        f"{facts.chunked_prefill_size}, batch ≤ {facts.max_running_requests}"
    )


def _description(
    base_url: str,
    grid: ProfileGrid,
    facts: EngineFacts,
    rtt: tuple[float, str],
    elapsed: float,
    command: str | None,
    gate: QuietGate,
) -> str:
    machine = machine_facts()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Measured by `{command or 'tandem profile'}` against {base_url} on {date} in "
        f"{elapsed:.0f} s; machine: {machine['cpu_count']}-core {machine['device'].upper()} "
        f"({machine['cpu']}); {gate.summary()}. Black box over HTTP (bench/profiler/measure.py): "
        f"decode-only = median inter-token gap of B concurrent streams; mixed = decode gap "
        f"of the iteration that ran an injected prefill; prefill-only = TTFT minus the round "
        f"trip ({rtt[0] * 1e3:.1f} ms: TTFT of a 1-token prompt minus its {rtt[1]}); median "
        f"of {grid.repeats} runs per point. Engine: {_facts_line(facts)}. Grid: {asdict(grid)}."
    )
