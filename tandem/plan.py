"""`tandem plan --trace FILE [--tenants FILE] [--profile …] --out DIR`: the fewest engine replicas
that meet every tenant's contract for a trace, found by simulation (bench/plan.py).

Prints a table (one row per replica count tried) and the answer; writes DIR/plan.json
(`replicas_needed` and the rows) and DIR/plan.png (attainment and cost against replicas). Bad
input prints one line, `tandem: error: …`, and exits with status 2; exit status 1 when no count
up to --max-replicas meets the target.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.defaults import DEFAULT_PROFILE
from tandem.bench import _OneLineParser


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `plan` to a subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="the fewest replicas meeting every tenant's contract for a trace (by simulation)",
        description=__doc__,
    )
    p.__class__ = _OneLineParser
    p.add_argument("--trace", type=Path, required=True, help="the trace (JSONL, bench/trace.py)")
    p.add_argument(
        "--tenants",
        type=Path,
        help="YAML: tenant name → contract (tier, ttft_ms, tpot_ms, deadline_s, weight, "
        "on_unattainable); default: RT lines get --ttft-s/--tpot-s",
    )
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"latency profile of one replica (default {DEFAULT_PROFILE})",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for plan.json and plan.png")
    p.add_argument("--policy", default="tandem", help="engine policy (default tandem)")
    p.add_argument("--router", default="slo", help="placement policy (default slo)")
    p.add_argument(
        "--target", type=float, default=0.99, help="attainment every tenant needs (default 0.99)"
    )
    p.add_argument("--max-replicas", type=int, default=1024, help="largest count (default 1024)")
    p.add_argument(
        "--sample-replicas",
        type=int,
        default=8,
        help="larger counts are judged on a sub-pool of this many (default 8)",
    )
    p.add_argument(
        "--rate-scale", type=float, default=1.0, help="replay speed (2 = twice the rate)"
    )
    p.add_argument(
        "--window-s",
        type=float,
        default=300.0,
        help="judge a longer trace on its busiest window of this many seconds, after a "
        "--warmup-s warm-up (default 300; 0: simulate the whole trace)",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="simulated before the judged window, not judged (default 60)",
    )
    p.add_argument("--ttft-s", type=float, default=0.4, help="RT TTFT without a contract")
    p.add_argument("--tpot-s", type=float, default=0.2, help="RT TPOT without a contract")
    p.set_defaults(func=cmd_plan)
    return p


def _config(args: argparse.Namespace) -> Any:
    from backend.policy.placement import ROUTERS
    from bench.plan import PlanConfig
    from bench.runner import registered_policies

    if not args.trace.is_file():
        raise ValueError(f"--trace {args.trace}: no such file")
    if args.tenants is not None and not args.tenants.is_file():
        raise ValueError(f"--tenants {args.tenants}: no such file")
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target must be in (0, 1], got {args.target:g}")
    if args.max_replicas < 1 or args.sample_replicas < 1:
        raise ValueError("--max-replicas and --sample-replicas must be ≥ 1")
    for flag in ("ttft_s", "tpot_s", "rate_scale"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    for flag in ("window_s", "warmup_s"):
        if not getattr(args, flag) >= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be ≥ 0")
    if args.router not in ROUTERS:
        raise ValueError(f"unknown router {args.router!r} (choose from {', '.join(ROUTERS)})")
    if args.policy.split(":")[0] not in registered_policies():
        raise ValueError(f"unknown policy {args.policy!r}")
    cfg = PlanConfig(
        trace_file=args.trace,
        out_dir=args.out,
        tenants_file=args.tenants,
        profile=args.profile,
        policy=args.policy,
        router=args.router,
        target=args.target,
        max_replicas=args.max_replicas,
        sample_replicas=args.sample_replicas,
        ttft_s=args.ttft_s,
        tpot_s=args.tpot_s,
        rate_scale=args.rate_scale,
        window_s=args.window_s,
        warmup_s=args.warmup_s,
    )
    words = ["tandem", "plan", "--trace", str(cfg.trace_file)]
    if cfg.tenants_file is not None:
        words += ["--tenants", str(cfg.tenants_file)]
    words += ["--profile", cfg.profile, "--policy", cfg.policy, "--router", cfg.router]
    words += ["--target", f"{cfg.target:g}", "--max-replicas", str(cfg.max_replicas)]
    words += ["--sample-replicas", str(cfg.sample_replicas)]
    if cfg.rate_scale != 1.0:
        words += ["--rate-scale", f"{cfg.rate_scale:g}"]
    words += ["--window-s", f"{cfg.window_s:g}", "--warmup-s", f"{cfg.warmup_s:g}"]
    words += ["--out", str(cfg.out_dir)]
    return replace(cfg, command=shlex.join(words))


def cmd_plan(args: argparse.Namespace) -> int:
    """Runs the plan command; one-line errors, exit status 2 on bad input."""
    from bench.plan import plan
    from bench.plan_report import percent, summary, table, write_plan

    try:
        cfg = _config(args)

        def progress(trial: Any) -> None:
            att = trial.min_attainment
            shown = "–" if att is None else percent(att, upper_bound=trial.stopped_early)
            print(
                f"  {trial.replicas} replicas: lowest tenant attainment {shown}"
                + (
                    " (stopped early: its requests known to have missed already miss the target)"
                    if trial.stopped_early
                    else ""
                )
                + f", {trial.wall_s:.1f} s",
                file=sys.stderr,
            )

        result = plan(cfg, report=progress)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    paths = write_plan(result, cfg.out_dir)
    print(table(result))
    print(summary(result))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0 if result.replicas_needed is not None else 1
