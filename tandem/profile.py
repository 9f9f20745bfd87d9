"""The options and the handler of `tandem profile` (see bench/profiler/measure.py for the method).

Every failure prints one line, ``tandem: error: <what went wrong>``, and returns 1 (2 for a bad
configuration); nothing is written then.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from backend.policy.calibration import REGIMES, regime_of
from backend.policy.latency import holdout_mape, save_profile
from bench.profiler.probe import ProfilerError
from common.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from bench.profiler.measure import ProfileGrid

DEFAULT_OUT = "profile.json"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `profile` options: target, output, grid."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help=f"profile file to write (default: {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--url", help="engine base URL (default: engine host and port of the config)"
    )
    parser.add_argument(
        "--config", default=argparse.SUPPRESS, help="config file (default: config.yaml)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small grid (about 20 s on the CPU tiny engine)"
    )
    parser.add_argument(
        "--launch",
        action="store_true",
        help="start the configured engine on a free port, profile it, stop it",
    )
    parser.add_argument("--name", help="profile name (default: the output file's stem)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="draw prompt ids below this (default: the model config's vocab_size)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        metavar="S",
        help="before each probe wait up to S seconds for this machine's CPUs "
        "to be idle (default 30; 0: never)",
    )
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="print held-out MAPE and weights of profile files; measure nothing",
    )
    grid = parser.add_argument_group("grid (comma-separated token or request counts)")
    for flag in (
        "decode-batches",
        "decode-contexts",
        "prefill-tokens",
        "prefill-prefixes",
        "mixed-prefill-tokens",
    ):
        grid.add_argument(f"--{flag}", type=_int_list, metavar="N,N,...")
    grid.add_argument("--repeats", type=int, help="runs per point (median kept)")
    grid.add_argument("--decode-steps", type=int, help="decode tokens per steady window")
    grid.add_argument("--seed", type=int, help="seed of the random prompts")


def run_profile_command(args: argparse.Namespace) -> int:
    """The handler: report, or measure (a running engine, or one started here) and write."""
    try:
        if args.report:
            from bench.profiler.report import report_lines

            for path in args.report:
                print("\n".join(report_lines(path)))
            return 0
        return _measure(args)
    except ConfigError as exc:
        return _fail(exc, 2)
    except (ProfilerError, RuntimeError, OSError, ValueError) as exc:
        return _fail(exc, 1)


def _fail(exc: BaseException, status: int) -> int:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(f"tandem: error: {message}", file=sys.stderr)
    return status


def _measure(args: argparse.Namespace) -> int:
    from bench.profiler.measure import profile_engine

    config = load_config(getattr(args, "config", None))  # absent: not given
    grid = grid_from_args(args)
    name = args.name or Path(args.out).stem
    command = getattr(args, "command_line", None) or "tandem " + shlex.join(sys.argv[1:])
    started = time.monotonic()
    with _engine(args, config) as base_url:
        profile = asyncio.run(
            profile_engine(
                base_url,
                grid=grid,
                name=name,
                vocab_size=args.vocab_size,
                command=command,
                quiet_wait_s=args.quiet_wait,
                progress=lambda line: print(f"  {line}", file=sys.stderr),
                headers=config.engine.auth_headers,  # an engine that requires its API key
            )
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, args.out)
    kinds = {"prefill": 0, "decode": 0, "mixed": 0}
    for sample in profile.samples:
        kinds[REGIMES[regime_of(sample.shape.num_prefill, sample.shape.num_decode)]] += 1
    print(
        f"wrote {args.out}: {len(profile.samples)} samples "
        f"({', '.join(f'{n} {k}' for k, n in kinds.items())}) in "
        f"{time.monotonic() - started:.0f} s"
    )
    if len(profile.samples) >= 5:
        _, error = holdout_mape(profile)
        n_test = max(1, int(len(profile.samples) * 0.2))
        print(f"held-out MAPE {error:.1%} on {n_test} points (fit on 80 %, seed 0)")
    else:
        print("too few samples to report a held-out MAPE")
    return 0


@contextmanager
def _engine(args: argparse.Namespace, config: Config) -> Iterator[str]:
    """Yields the engine's base URL: --url, the config's engine, or one launched here."""
    from backend.launch.sglang import (
        EngineProcess,
        engine_base_url,
        engine_env,
        server_argv,
    )

    if not args.launch:
        yield (args.url or engine_base_url(config.engine)).rstrip("/")
        return
    if args.url:
        raise ProfilerError("--launch starts its own engine; leave out --url")
    # The probes shape each iteration themselves (batch sizes, prompt lengths): SGLang's own
    # scheduling runs them, not a policy that would cut chunks or park decodes.
    engine_cfg = msgspec.structs.replace(
        config.engine, host="127.0.0.1", port=_free_port(), policy="none"
    )
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-profile-"))
    engine = EngineProcess(
        server_argv(
            engine_cfg,
            _model_dir(config),
            config.model.name,
            random_weights=config.model.uses_random_weights,
        ),
        engine_env(engine_cfg),
        base_url=engine_base_url(engine_cfg),
        log_path=log_dir / "engine.log",
    )
    print(f"starting the engine (log: {engine.log_path}) ...", file=sys.stderr)
    with engine:
        engine.wait_ready_sync(engine_cfg.startup_timeout_s)
        yield engine.base_url


def _model_dir(config: Config) -> Path:
    """The model directory `tandem serve` would serve (checked the same way)."""
    from tandem.serve import resolve_model_dir

    return resolve_model_dir(config.model)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def grid_from_args(args: argparse.Namespace) -> ProfileGrid:
    """The grid `--quick` and the grid options describe."""
    from bench.profiler.measure import ProfileGrid

    grid = ProfileGrid.quick() if args.quick else ProfileGrid()
    overrides: dict[str, Any] = {}
    for key in (
        "decode_batches",
        "decode_contexts",
        "prefill_tokens",
        "prefill_prefixes",
        "mixed_prefill_tokens",
    ):
        if getattr(args, key, None) is not None:
            overrides[key] = tuple(getattr(args, key))
    for key in ("repeats", "decode_steps", "seed"):
        if getattr(args, key, None) is not None:
            overrides[key] = getattr(args, key)
    return replace(grid, **overrides)


# ---------------------------------------------------------------------- command line


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `profile` to a `tandem` sub-command parser (argparse's add_subparsers result)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="measure the engine's iteration latency, write a profile",
        description="Measures a running engine's iteration latency over a grid of batch "
        "shapes (HTTP only) and writes the profile the latency model and the "
        "simulator use.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run_profile_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tandem.profile ...`: the same options as `tandem profile`."""
    parser = argparse.ArgumentParser(prog="python -m tandem.profile")
    add_profile_parser(parser.add_subparsers(dest="command"))
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["profile", *argv])
    args.command_line = shlex.join(["python", "-m", "tandem.profile", *argv])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
