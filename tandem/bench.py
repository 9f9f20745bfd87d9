"""`tandem bench WORKLOAD|trace …`: the command line of the bench runner (API.md).

tandem/cli.py wires it in with `add_bench_parser(sub)`. Bad input prints one line,
`tandem: error: …`, and exits with status 2 (argparse's own usage errors included).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast, get_args

from bench.defaults import (
    DEFAULT_DATA_DIR,
    DEFAULT_PROFILE,
    ENGINES,
    RESULTS_DIR,
    WORKLOAD_NAMES,
)
from common.slowdown import Slowdown, format_slowdown, parse_slowdown

if TYPE_CHECKING:
    from backend.sim.config import SloUnattainable
    from bench.runner import BenchConfig


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block), unknown options included."""

    def error(self, message: str) -> NoReturn:
        print(f"tandem: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/tandem, else ~/.cache/tandem (the λ* cache)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "tandem"


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `bench` to a subparsers object (from ArgumentParser.add_subparsers)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="run a workload against every policy; write report.md, results.json, PNG plots",
        description=__doc__,
    )
    p.__class__ = _OneLineParser
    p.add_argument("workload", metavar="WORKLOAD", help="W1…W6, or trace (then FILE.jsonl)")
    p.add_argument("trace_file", nargs="?", metavar="FILE.jsonl", help="trace to replay")
    p.add_argument("--engine", choices=ENGINES, default="sim", help="engine (default sim)")
    p.add_argument(
        "--policies",
        help="comma-separated policy names, each optionally with "
        "constructor options as NAME:KEY=VALUE[:KEY=VALUE] (default: all)",
    )
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--load",
        type=float,
        help="RT rate as a fraction of λ* (default 0.75; "
        "W3: fraction of the heaviest client count; W5: peak of the burst)",
    )
    rate.add_argument("--rt-rate", type=float, help="fixed RT arrival rate, req/s")
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"latency profile: NAME in backend/policy/profiles/ or a FILE "
        f"(default {DEFAULT_PROFILE})",
    )
    p.add_argument("--kv-scale", type=float, help="KV pool = F × the longest prompt")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--out", type=Path, help="output folder (default bench/results/<workload>-<timestamp>)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="folder of the Azure trace CSVs (default bench/data, shipped with tandem)",
    )
    p.add_argument("--scale", type=float, help="fraction of the full-size workload")
    p.add_argument("--duration-s", type=float, help="arrival window, simulated seconds")
    p.add_argument("--variant", help="W1 class|hetero|cpu, W3 d1|d2|d3, W4 p35|p5, W6 full|cpu")
    p.add_argument(
        "--max-new",
        choices=("exact", "cap"),
        default="cap",
        help="max_new_tokens policies see: exact (= output length) or cap",
    )
    p.add_argument("--rate-scale", type=float, help="trace only: replay speed (2 = twice the rate)")
    p.add_argument("--ttft-s", type=float, help="trace only: RT TTFT target (default 0.4)")
    p.add_argument("--tpot-s", type=float, help="trace only: RT TPOT target (default 0.2)")
    p.add_argument("--cache-dir", type=Path, help="λ* cache folder (default ~/.cache/tandem)")
    p.add_argument(
        "--capacity-run-s",
        type=float,
        default=60.0,
        help="simulated seconds per λ* search run (default 60)",
    )
    p.add_argument(
        "--engine-slowdown",
        metavar="K|K1@T1,K2@T2,…",
        help="the engine runs K × slower than the policies' latency model predicts (K > 0); "
        "a schedule changes K at second T of the run (first T = 0). --engine sglang: every "
        "policy's real engine sleeps (K − 1) × each forward pass from its replay's start "
        "(K ≥ 1; engine.slowdown), and the twin runs the engine's own pace with the schedule",
    )
    p.add_argument(
        "--engine-noise",
        type=float,
        metavar="SIGMA",
        help="sim only: the engine's pace jitters per iteration, each taking a further "
        "log-normal factor of mean 1 (SIGMA: the σ of its log, 0–2; 0.3 puts one iteration in "
        "twenty at 1.6× the mean pace or more), drawn from --seed; the policies are not told",
    )
    p.add_argument(
        "--replica-slowdowns",
        metavar="K0,K1,…",
        help="sim pool only: replica i runs K_i times slower again than the others (K_i > 0; "
        "replicas past the list: 1), an unequal pool: e.g. 3,3 for two replicas at a third of "
        "the speed",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="sim only: N engine replicas behind the router (default 1; with N > 1 and no "
        "--routers, the slo router); the RT rate is load × N × one replica's λ*",
    )
    p.add_argument(
        "--routers",
        help="sim only: comma-separated placement policies to compare on the replicas "
        "(slo, round-robin, least-load, prefix); results.json gains `routers`",
    )
    p.add_argument(
        "--on-unattainable",
        metavar="OUTCOME|TENANT=OUTCOME,…",
        help="sim only: what the SLO admission does with an RT request forecast to miss its "
        "contract — reject (the default), downgrade (run it as BE) or accept (run it as RT "
        "anyway) — for every tenant, or per tenant (e.g. rt-burst=accept; the others "
        "reject unless a bare OUTCOME is given too)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_bench)
    return p


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value:g}")


def _workload_name(args: argparse.Namespace) -> str:
    name = args.workload.upper() if args.workload.lower() != "trace" else "trace"
    if name not in (*WORKLOAD_NAMES, "trace"):
        raise ValueError(
            f"unknown workload {args.workload!r} (choose from {', '.join(WORKLOAD_NAMES)}, trace)"
        )
    if name == "trace" and args.trace_file is None:
        raise ValueError("bench trace needs a FILE.jsonl")
    if name != "trace" and args.trace_file is not None:
        raise ValueError(
            f"unexpected argument {args.trace_file!r} (only `bench trace` takes a file)"
        )
    trace_only = {"--rate-scale": args.rate_scale, "--ttft-s": args.ttft_s, "--tpot-s": args.tpot_s}
    given = [flag for flag, value in trace_only.items() if value is not None]
    if name != "trace" and given:
        raise ValueError(f"{', '.join(given)}: only for `bench trace`")
    return name


def _policies(spec: str | None) -> tuple[str, ...] | None:
    """The --policies list: registry names, each optionally with options
    (`bench/policy_spec.py`: NAME[:KEY=VALUE…])."""
    if spec is None:
        return None
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    if not names:
        raise ValueError("--policies is empty")
    from bench.policy_spec import parse_policy_spec
    from bench.runner import registered_policies

    known = registered_policies()
    for name in names:
        base, _ = parse_policy_spec(name)
        if base not in known:
            raise ValueError(f"unknown policy {base!r} (choose from {', '.join(known)})")
    if len(set(names)) != len(names):
        raise ValueError("--policies names a policy twice")
    return names


def _routers(args: argparse.Namespace) -> tuple[int, tuple[str, ...] | None]:
    """(replicas, routers) from --replicas and --routers."""
    from backend.policy.placement import ROUTERS

    replicas = 1 if args.replicas is None else args.replicas
    if replicas < 1:
        raise ValueError(f"--replicas must be ≥ 1, got {replicas}")
    if args.routers is None:
        if replicas == 1:
            return 1, None
        routers: tuple[str, ...] = ("slo",)
    else:
        routers = tuple(n.strip() for n in args.routers.split(",") if n.strip())
        if not routers:
            raise ValueError("--routers is empty")
        for name in routers:
            if name not in ROUTERS:
                raise ValueError(f"unknown router {name!r} (choose from {', '.join(ROUTERS)})")
        if len(set(routers)) != len(routers):
            raise ValueError("--routers names a router twice")
    if args.engine != "sim":
        raise ValueError(f"--replicas/--routers: only for --engine sim, not {args.engine}")
    return replicas, routers


def _command(cfg: BenchConfig) -> str:
    """The full command line of the run (every effective option)."""
    words = ["tandem", "bench", cfg.workload]
    if cfg.trace_file is not None:
        words.append(str(cfg.trace_file))
    words += ["--engine", cfg.engine]
    if cfg.policies:
        words += ["--policies", ",".join(cfg.policies)]
    words += (
        ["--rt-rate", f"{cfg.rt_rate_req_s:g}"]
        if cfg.rt_rate_req_s is not None
        else ["--load", f"{cfg.load:g}"]
    )
    words += ["--profile", cfg.profile, "--seed", str(cfg.seed)]
    if cfg.capacity_run_s != 60.0:
        words += ["--capacity-run-s", f"{cfg.capacity_run_s:g}"]
    optional = {
        "--kv-scale": cfg.kv_scale,
        "--scale": cfg.scale,
        "--duration-s": cfg.duration_s,
        "--variant": cfg.variant,
    }
    words += [
        w
        for flag, v in optional.items()
        if v is not None
        for w in (flag, f"{v:g}" if isinstance(v, float) else str(v))
    ]
    if cfg.max_new != "cap":
        words += ["--max-new", cfg.max_new]
    if cfg.workload == "trace":
        words += ["--rate-scale", f"{cfg.rate_scale:g}"]
    if cfg.engine_slowdown:
        words += ["--engine-slowdown", format_slowdown(cfg.engine_slowdown)]
    if cfg.routers is not None:
        words += ["--replicas", str(cfg.replicas), "--routers", ",".join(cfg.routers)]
    if cfg.replica_slowdowns:
        words += ["--replica-slowdowns", ",".join(f"{k:g}" for k in cfg.replica_slowdowns)]
    if cfg.engine_noise:
        words += ["--engine-noise", f"{cfg.engine_noise:g}"]
    if cfg.on_unattainable:
        words += [
            "--on-unattainable",
            ",".join(f"{t}={o}" if t else o for t, o in cfg.on_unattainable),
        ]
    return shlex.join([*words, "--out", str(cfg.out_dir)])


def _engine_slowdown(args: argparse.Namespace) -> Slowdown:
    """The --engine-slowdown schedule (() when not given)."""
    if args.engine_slowdown is None:
        return ()
    try:
        schedule = parse_slowdown(args.engine_slowdown)
    except ValueError as exc:
        raise ValueError(f"--engine-slowdown {args.engine_slowdown!r}: {exc}") from None
    if args.engine != "sim":
        # the real engine sleeps after each forward pass (engine.slowdown): slower, never faster
        fast = [k for _, k in schedule if k < 1.0]
        if fast:
            raise ValueError(
                f"--engine-slowdown {args.engine_slowdown!r}: factor {fast[0]:g} < 1; the "
                f"real engine ({args.engine}) can be made slower, not faster"
            )
    return schedule


def _engine_noise(args: argparse.Namespace) -> float:
    """The --engine-noise σ (0 when not given)."""
    from backend.sim.config import MAX_ENGINE_NOISE

    sigma = getattr(args, "engine_noise", None)
    if sigma is None:
        return 0.0
    if args.engine != "sim":
        raise ValueError(
            f"--engine-noise: only for the simulated engine (--engine sim); the real engine "
            f"({args.engine}) jitters on its own, and --engine-slowdown stretches it"
        )
    if not 0.0 <= sigma <= MAX_ENGINE_NOISE:
        raise ValueError(f"--engine-noise must be in [0, {MAX_ENGINE_NOISE:g}], got {sigma:g}")
    return float(sigma)


def _replica_slowdowns(args: argparse.Namespace, replicas: int) -> tuple[float, ...]:
    """The --replica-slowdowns factors (() when not given)."""
    spec = getattr(args, "replica_slowdowns", None)
    if spec is None:
        return ()
    if args.engine != "sim" or replicas < 2:
        raise ValueError("--replica-slowdowns: only for a simulated pool (--replicas N > 1)")
    try:
        factors = tuple(float(word) for word in spec.split(","))
    except ValueError:
        raise ValueError(f"--replica-slowdowns {spec!r}: not a comma-separated list") from None
    if not all(k > 0 for k in factors):
        raise ValueError(f"--replica-slowdowns {spec!r}: every factor must be > 0")
    if len(factors) > replicas:
        raise ValueError(
            f"--replica-slowdowns {spec!r}: {len(factors)} factors for {replicas} replicas"
        )
    return factors


def _on_unattainable(args: argparse.Namespace) -> tuple[tuple[str, SloUnattainable], ...]:
    """The --on-unattainable outcomes as (tenant, outcome) pairs, tenant "" for the rest."""
    from backend.sim import config as sim_config

    spec = getattr(args, "on_unattainable", None)
    if spec is None:
        return ()
    if args.engine != "sim":
        raise ValueError(
            "--on-unattainable: only for the simulated engine (--engine sim); on the real "
            "engine it is each tenant's contract (tandem admin tenant update T --on-unattainable …)"
        )
    outcomes = get_args(sim_config.SloUnattainable)
    pairs: dict[str, SloUnattainable] = {}
    for item in spec.split(","):
        tenant, _, outcome = item.strip().rpartition("=")
        tenant = tenant.strip()
        outcome = outcome.strip()
        if outcome not in outcomes:
            raise ValueError(
                f"--on-unattainable {spec!r}: {outcome!r} is no outcome "
                f"(choose from {', '.join(outcomes)})"
            )
        if "=" in item and not tenant:
            raise ValueError(f"--on-unattainable {spec!r}: {item.strip()!r} names no tenant")
        if tenant in pairs:
            what = f"tenant {tenant!r}" if tenant else "the bare outcome"
            raise ValueError(f"--on-unattainable {spec!r}: {what} is given twice")
        pairs[tenant] = cast("SloUnattainable", outcome)
    return tuple(pairs.items())


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The validated BenchConfig; ValueError with a one-line message on bad input."""
    from bench.runner import BenchConfig

    name = _workload_name(args)
    for flag in (
        "load",
        "rt_rate",
        "kv_scale",
        "scale",
        "duration_s",
        "rate_scale",
        "ttft_s",
        "tpot_s",
        "capacity_run_s",
    ):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.kv_scale is not None and args.kv_scale <= 1:
        raise ValueError(
            f"--kv-scale must be > 1 (the pool must hold the longest prompt), got {args.kv_scale:g}"
        )
    if args.seed < 0:
        raise ValueError(f"--seed must be ≥ 0, got {args.seed}")
    replicas, routers = _routers(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS_DIR / f"{name}-{stamp}"
    cfg = BenchConfig(
        workload=name,
        out_dir=out,
        engine=args.engine,
        policies=_policies(args.policies),
        load=args.load if args.load is not None else 0.75,
        rt_rate_req_s=args.rt_rate,
        profile=args.profile,
        kv_scale=args.kv_scale,
        seed=args.seed,
        data_dir=args.data_dir,
        scale=args.scale,
        duration_s=args.duration_s,
        variant=args.variant,
        max_new=args.max_new,
        trace_file=Path(args.trace_file) if args.trace_file else None,
        rate_scale=args.rate_scale or 1.0,
        trace_ttft_s=args.ttft_s or 0.4,
        trace_tpot_s=args.tpot_s or 0.2,
        cache_dir=args.cache_dir or _default_cache_dir(),
        capacity_run_s=args.capacity_run_s,
        engine_slowdown=_engine_slowdown(args),
        replica_slowdowns=_replica_slowdowns(args, replicas),
        engine_noise=_engine_noise(args),
        on_unattainable=_on_unattainable(args),
        replicas=replicas,
        routers=routers,
        progress=not args.no_progress,
    )
    return replace(cfg, command=_command(cfg))


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs the bench command; one-line errors, exit status 2 on bad input."""
    from bench.report import write_outputs
    from bench.runner import run_bench

    try:
        cfg = config_from_args(args)
        if cfg.engine == "sglang":
            return _cmd_bench_live(cfg)
        run = run_bench(cfg)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    return _finish(write_outputs(run, cfg.out_dir), run.failed)


def _cmd_bench_live(cfg: BenchConfig) -> int:
    """`--engine sglang`: the real engine behind the gateway, and its simulator twin."""
    from bench.live import live_config, run_live
    from bench.live_report import write_live_outputs

    cfg = live_config(cfg)
    cfg = replace(cfg, command=_command(cfg))  # the profile and variant the live run uses
    run = run_live(cfg)
    return _finish(write_live_outputs(run, cfg.out_dir), run.failed)


def _finish(paths: Sequence[Path], failed: dict[str, str]) -> int:
    """Says what was written; exit status 1 when a policy failed."""
    print(f"wrote {', '.join(str(p) for p in paths)}")
    if failed:
        print(f"tandem: error: policy {', '.join(failed)} failed (see report.md)", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tandem.bench bench …` (the same as `tandem bench …`)."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_bench_parser(parser.add_subparsers(metavar="COMMAND"))
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
