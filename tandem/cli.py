"""The `tandem` command line (also `python -m gateway`).

Every failure prints one line, `tandem: error: <what went wrong>`, and exits with status 2 (bad
input or configuration) or 1 (a runtime failure).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from common.config import ConfigError, load_config
from tandem.database import migrate_database, redact_url
from tandem.errors import CliError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except ConfigError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except CliError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130


def _stdout_closed() -> int:
    """What `tandem batch list | head` gets once `head` has read enough: no traceback, and
    the status of a process ended by SIGPIPE (what well-behaved Unix tools exit with)."""
    # Python flushes stdout again at exit; pointing it at /dev/null keeps that one quiet too.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand that does not see --config leaves the one given before it
    # (`tandem --config X db upgrade`) instead of resetting it to the default.
    common.add_argument(
        "--config", default=argparse.SUPPRESS, help="config file (default: config.yaml)"
    )
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    # Its own action, not common's: parsers made with `parents` share their action objects,
    # so a default set here would be every subcommand's default too.
    parser.add_argument("--config", default=None, help="config file (default: config.yaml)")
    sub = parser.add_subparsers(metavar="COMMAND")

    serve = sub.add_parser("serve", parents=[common], help="start the engine and the gateway")
    serve.add_argument(
        "--skip-profile",
        action="store_true",
        help="never measure a latency profile for the engine (engine.skip_profile): use the "
        "stored one, else the bundled one, with a warning",
    )
    serve.set_defaults(func=_cmd_serve)

    db = sub.add_parser("db", help="database schema").add_subparsers(metavar="ACTION")
    db.add_parser("upgrade", parents=[common], help="migrate to the newest schema").set_defaults(
        func=_cmd_db_upgrade
    )

    model = sub.add_parser("model", help="the served model").add_subparsers(metavar="ACTION")
    model.add_parser(
        "path", parents=[common], help="print the model directory (creates the built-in model)"
    ).set_defaults(func=_cmd_model_path)

    from tandem.admin import add_admin_parser

    add_admin_parser(sub, common)
    from tandem.bench import add_bench_parser

    add_bench_parser(sub)
    from tandem.plan import add_plan_parser

    add_plan_parser(sub)
    from tandem.batch import add_batch_parser

    add_batch_parser(sub, common)
    from tandem.profile import add_profile_parser

    add_profile_parser(sub)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    from tandem.serve import serve

    config = load_config(args.config)
    if args.skip_profile:
        engine = msgspec.structs.replace(config.engine, skip_profile=True)
        config = msgspec.structs.replace(config, engine=engine)
    return serve(config)


def _cmd_db_upgrade(args: argparse.Namespace) -> int:
    from gateway.store.migrate import head_revision

    config = load_config(args.config)
    migrate_database(config.database.url)
    _print({"database": redact_url(config.database.url), "revision": head_revision()})
    return 0


def _cmd_model_path(args: argparse.Namespace) -> int:
    from tandem.serve import resolve_model_dir

    print(resolve_model_dir(load_config(args.config).model))
    return 0


def _print(payload: Any) -> None:
    print(json.dumps(msgspec.to_builtins(payload), indent=2))
