"""The hardening bench (issue 16): the gateway's load, saturation, memory and own latency in front
of a fake engine that answers at once, and the reliability tier's fuzz counts.

    python -m bench.hardening latency  --rate 500 --duration-s 20 [--no-stream]
    python -m bench.hardening capacity --rates 200,400,600,800 --duration-s 10 [--no-stream]
    python -m bench.hardening soak     --soak-s 600 --rate 200
    python -m bench.hardening profile  --rate 500 --duration-s 20 [--py-spy]
    python -m bench.hardening fuzz
    python -m bench.hardening fake-engine --port 30000

The gateway runs pinned to CPU 0 (`taskset -c 0`), the fake engine and this load generator to
CPU 1: the gateway's figures are for one core. Run everything under `nice -n 15` on a shared
machine. Results print as JSON lines (and go to --out when given). bench/hardening/README.md has
the figures and the commands that made them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.hardening.fake_engine import create_fake_engine
from bench.hardening.load import Outcome, Target, run_open_loop, warm_up
from bench.hardening.procs import (
    ADMIN_TOKEN,
    CLIENT_CPU,
    MODEL,
    Gateway,
    cpu_seconds,
    fake_engine,
    gateway,
    pin_to,
    rss_bytes,
)

REPO = Path(__file__).resolve().parents[2]


def _emit(record: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return asyncio.run(coro)


def _gateway_target(gw: Gateway, stream: bool) -> Target:
    return Target(f"{gw.base_url}/v1/chat/completions", gw.key, MODEL, stream)


def _direct_target(engine_url: str, stream: bool) -> Target:
    return Target(f"{engine_url}/v1/chat/completions", "direct", MODEL, stream)


def _measure(target: Target, rate: float, duration_s: float) -> Outcome:
    async def go() -> Outcome:
        await warm_up(target)
        return await run_open_loop(target, rate, duration_s)

    return _run(go())  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- commands


def cmd_latency(args: argparse.Namespace) -> int:
    """Added latency: the same open-loop load straight to the fake engine, then through the
    gateway; the difference of their percentiles is the gateway's own time."""
    pin_to(CLIENT_CPU)
    with fake_engine() as engine_url:
        direct = _measure(_direct_target(engine_url, args.stream), args.rate, args.duration_s)
        with gateway(engine_url, database_url=args.database_url) as gw:
            via = _measure(_gateway_target(gw, args.stream), args.rate, args.duration_s)
            loop = _loop_report(gw)
    d, g = direct.row(), via.row()
    added = {
        f"added_{k}": round(g[k] - d[k], 2)
        for k in ("e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "ttft_p50_ms", "ttft_p99_ms")
        if g[k] is not None and d[k] is not None
    }
    _emit({"command": "latency", "direct": d, "gateway": g, **added, "loop": loop}, args.out)
    return 0


def _loop_report(gw: Gateway) -> dict[str, Any]:
    """The gateway's own view of its event loop over the run (gateway/loop_watch.py): probes,
    how many ran 10 ms / 50 ms late or more, and the stalls by where the loop was held."""
    text = requests.get(
        f"{gw.base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10
    ).text
    buckets: dict[str, float] = {}
    stalls: dict[str, int] = {}
    inside: dict[str, float] = {}  # the gateway's own arrival-to-last-byte, by bucket bound
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_event_loop_lag_seconds_bucket":
                buckets[sample.labels["le"]] = sample.value
            elif sample.name == "tandem_request_duration_seconds_bucket":
                bound = sample.labels["le"]
                inside[bound] = inside.get(bound, 0.0) + sample.value
            elif sample.name == "tandem_event_loop_stalls_total":
                stalls[sample.labels["where"]] = int(sample.value)
    probes = buckets.get("+Inf", 0.0)
    return {
        "probes": int(probes),
        "late_10ms_or_more": int(probes - buckets.get("0.01", probes)),
        "late_50ms_or_more": int(probes - buckets.get("0.05", probes)),
        "stalls_by_where": dict(sorted(stalls.items(), key=lambda kv: -kv[1])),
        # what the gateway itself measured from a request's arrival (its handler starting) to
        # its last byte: a client-side tail far beyond it waited outside the gateway's handlers
        "gateway_requests": int(inside.get("+Inf", 0.0)),
        "gateway_requests_within_bound_s": {
            bound: int(count)
            for bound, count in sorted(inside.items(), key=lambda kv: float(kv[0]))
        },
    }


def cmd_capacity(args: argparse.Namespace) -> int:
    """Steps the rate up; the highest one the gateway answers with 0 errors is what it holds,
    the steps past it show how it behaves saturated (statuses, p99)."""
    pin_to(CLIENT_CPU)
    rates = [float(r) for r in args.rates.split(",")]
    with fake_engine() as engine_url, gateway(engine_url, database_url=args.database_url) as gw:
        target = _gateway_target(gw, args.stream)
        _run(warm_up(target))
        held = 0.0
        for rate in rates:
            cpu_before_s = cpu_seconds(gw.pid)
            row = _run(run_open_loop(target, rate, args.duration_s)).row()
            row["gateway_rss_mb"] = round(rss_bytes(gw.pid) / 2**20, 1)
            # the gateway's CPU over the step (and its drain): what the answers cost it
            row["gateway_cpu_s"] = round(cpu_seconds(gw.pid) - cpu_before_s, 2)
            row["gateway_shed"] = _shed_counts(gw)
            _emit({"command": "capacity", **row}, args.out)
            if row["errors"] == 0 and row["late_p99_ms"] < 50:
                held = max(held, rate)
            time.sleep(args.pause_s)  # let queues drain between steps
    _emit({"command": "capacity", "stream": args.stream, "held_rps_at_0_errors": held}, args.out)
    return 0


def _shed_counts(gw: Gateway) -> dict[str, int] | str:
    """The gateway's 503s so far, by why (gateway/overload.py, gateway/server.py); a string
    saying so when /metrics does not answer within 10 s (a gateway still behind its flood)."""
    try:
        text = requests.get(
            f"{gw.base_url}/metrics",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        ).text
    except requests.RequestException as exc:
        return f"/metrics did not answer: {type(exc).__name__}"
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_gateway_requests_shed_total":
                out[f"request_{sample.labels.get('reason', 'in_flight')}"] = int(sample.value)
            elif sample.name == "tandem_gateway_connections_shed_total":
                out["connection_queue_wait"] = int(sample.value)
            elif sample.name == "tandem_gateway_connections_refused_total":
                out["connection_cap"] = int(sample.value)
    return out


def cmd_soak(args: argparse.Namespace) -> int:
    """Constant load for --soak-s seconds; the gateway's RSS sampled from /proc every
    --sample-s (nothing scrapes /metrics: memory that only a scrape would trim shows)."""
    pin_to(CLIENT_CPU)
    with fake_engine() as engine_url, gateway(engine_url, database_url=args.database_url) as gw:
        target = _gateway_target(gw, args.stream)
        _run(warm_up(target))
        samples: list[tuple[float, float]] = []

        async def sample(start: float) -> None:
            while True:
                samples.append((time.monotonic() - start, rss_bytes(gw.pid) / 2**20))
                await asyncio.sleep(args.sample_s)

        async def go() -> Outcome:
            start = time.monotonic()
            sampler = asyncio.create_task(sample(start))
            try:
                return await run_open_loop(target, args.rate, args.soak_s)
            finally:
                sampler.cancel()
                samples.append((time.monotonic() - start, rss_bytes(gw.pid) / 2**20))

        outcome: Outcome = _run(go())
    # after the first minute (caches, pools, allocator arenas fill), growth is what leaks
    settled = [mb for t, mb in samples if t >= min(60.0, args.soak_s / 4)] or [
        s[1] for s in samples
    ]
    record = {
        "command": "soak",
        **outcome.row(),
        "rss_mb_series": [[round(t, 1), round(mb, 1)] for t, mb in samples],
        "rss_first_mb": round(samples[0][1], 1),
        "rss_settled_first_mb": round(settled[0], 1),
        "rss_last_mb": round(samples[-1][1], 1),
        "rss_max_mb": round(max(mb for _, mb in samples), 1),
        "rss_growth_after_settling_pct": round(100.0 * (max(settled) - settled[0]) / settled[0], 2),
    }
    _emit(record, args.out)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """The gateway's hot path under load: cProfile of the whole gateway process (or py-spy's
    samples with --py-spy), top functions by own time."""
    pin_to(CLIENT_CPU)
    with tempfile.TemporaryDirectory(prefix="tandem-profile-") as tmp:
        prof = args.prof_out or Path(tmp) / "gateway.prof"
        with (
            fake_engine() as engine_url,
            gateway(
                engine_url,
                database_url=args.database_url,
                cprofile_out=None if args.py_spy else prof,
            ) as gw,
        ):
            target = _gateway_target(gw, args.stream)
            _run(warm_up(target))
            spy = None
            if args.py_spy:
                raw = Path(tmp) / "spy.txt"
                spy = subprocess.Popen(
                    [
                        _py_spy(),
                        "record",
                        "--pid",
                        str(gw.pid),
                        "--rate",
                        "500",
                        "--format",
                        "raw",
                        "--nonblocking",
                        "--output",
                        str(raw),
                        "--duration",
                        str(int(args.duration_s)),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            outcome = _run(run_open_loop(target, args.rate, args.duration_s))
            if spy is not None:
                spy.wait(60)
        _emit({"command": "profile", **outcome.row()}, args.out)
        if args.py_spy:
            _print_spy(Path(tmp) / "spy.txt", args.top)
        else:
            stats = pstats.Stats(str(prof))
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(r"(gateway|aiohttp|msgspec)", args.top)
    return 0


def _py_spy() -> str:
    """py-spy beside this Python (a venv's bin/), else on the PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy") or "py-spy"


def _print_spy(raw: Path, top: int) -> None:
    """Own-time and inclusive-time shares per function from py-spy's collapsed stacks."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
    print(f"py-spy: {total} samples")
    for title, table in (("own", own), ("inclusive", inclusive)):
        print(f"-- top {top} by {title} time")
        for frame, count in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{100.0 * count / total:6.2f}%  {frame}")


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Runs the reliability tier (tests/reliability) and prints its counts: cases tried, 5xx."""
    argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    argv += ["tests/reliability", *(["-k", args.k] if args.k else [])]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    # pytest's progress letters may precede a test's printed line on the same line
    lines = proc.stdout.splitlines()
    counts = [line[line.index("reliability ") :] for line in lines if "reliability " in line]
    for line in counts:
        print(line)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    _emit({"command": "fuzz", "counts": counts, "pytest": summary}, args.out)
    return proc.returncode


def cmd_fake_engine(args: argparse.Namespace) -> int:
    web.run_app(create_fake_engine(), host="127.0.0.1", port=args.port, print=None)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hardening",
        description="The gateway's load, saturation, memory and own latency in front of a fake "
        "engine (gateway on CPU 0, engine and load on CPU 1), and the fuzz counts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--stream",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="streaming chat requests (default) or not",
        )
        p.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
        p.add_argument("--out", type=Path, default=None, help="append the JSON lines here")

    p = sub.add_parser("latency", help="added latency: gateway path minus direct path")
    common(p)
    p.add_argument("--rate", type=float, default=500.0, help="requests per second")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.set_defaults(func=cmd_latency)

    p = sub.add_parser("capacity", help="step the rate: load held at 0 errors, then saturation")
    common(p)
    p.add_argument("--rates", default="200,400,600,800,1000", help="comma-separated req/s")
    p.add_argument("--duration-s", type=float, default=10.0, help="per step")
    p.add_argument("--pause-s", type=float, default=2.0, help="between steps")
    p.set_defaults(func=cmd_capacity)

    p = sub.add_parser("soak", help="RSS over a long constant load, no /metrics scrape")
    common(p)
    p.add_argument("--soak-s", type=float, default=600.0)
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.set_defaults(func=cmd_soak)

    p = sub.add_parser("profile", help="profile the gateway under load (cProfile or py-spy)")
    common(p)
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--py-spy", action="store_true", help="sample with py-spy (if installed)")
    p.add_argument("--prof-out", type=Path, default=None, help="keep the cProfile file here")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("fuzz", help="run tests/reliability and print its counts")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("fake-engine", help="serve the fake engine (the bench starts it itself)")
    p.add_argument("--port", type=int, required=True)
    p.set_defaults(func=cmd_fake_engine)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
