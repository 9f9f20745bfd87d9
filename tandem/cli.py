"""The `tandem` command line (also `python -m gateway`).

Every failure prints one line, `tandem: error: <what went wrong>`, and exits with status 2 (bad
input or configuration) or 1 (a runtime failure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from common.config import ConfigError, load_config
from tandem.errors import CliError


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ConfigError, CliError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=None, help="config file (default: config.yaml)")
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__, parents=[common])
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

    admin = sub.add_parser("admin", help="tenants and keys").add_subparsers(metavar="OBJECT")
    tenant = admin.add_parser("tenant", help="tenants").add_subparsers(metavar="ACTION")
    create = tenant.add_parser("create", parents=[common], help="create a tenant")
    create.add_argument("name")
    create.add_argument("--tier", choices=["rt", "be"], required=True)
    # The flags keep API.md's spelling; the values are targets, so they land in *_target_ms.
    create.add_argument(
        "--ttft-ms", dest="ttft_target_ms", type=float, help="RT: time-to-first-token target, ms"
    )
    create.add_argument(
        "--tpot-ms", dest="tpot_target_ms", type=float, help="RT: time-per-output-token target, ms"
    )
    create.add_argument("--deadline-s", type=float, help="BE: job deadline, seconds")
    create.add_argument(
        "--allow-rt",
        action="store_true",
        help="BE tenant may ask for tier rt per request (needs RT targets)",
    )
    for flag, unit in (
        ("requests-per-min", "requests"),
        ("tokens-per-min", "tokens"),
        ("max-concurrent", "requests in flight"),
        ("monthly-tokens", "tokens per calendar month"),
    ):
        create.add_argument(f"--{flag}", type=int, help=f"quota: {unit} (default: unlimited)")
    create.set_defaults(func=_cmd_tenant_create)
    tenant.add_parser("list", parents=[common], help="list tenants").set_defaults(
        func=_cmd_tenant_list
    )
    key = admin.add_parser("key", help="API keys").add_subparsers(metavar="ACTION")
    key_create = key.add_parser("create", parents=[common], help="create a key (shown once)")
    key_create.add_argument("tenant", help="tenant id or name")
    key_create.add_argument("--name", help="a label for the key")
    key_create.set_defaults(func=_cmd_key_create)
    key_revoke = key.add_parser("revoke", parents=[common], help="revoke a key")
    key_revoke.add_argument("key_id")
    key_revoke.set_defaults(func=_cmd_key_revoke)
    from tandem.usage import add_usage_command

    add_usage_command(admin, common)
    from tandem.bench import add_bench_parser

    add_bench_parser(sub)
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
    from gateway.store.migrate import head_revision, upgrade

    config = load_config(args.config)
    upgrade(config.database.url)
    _print({"database": _redact(config.database.url), "revision": head_revision()})
    return 0


def _cmd_model_path(args: argparse.Namespace) -> int:
    from tandem.serve import resolve_model_dir

    print(resolve_model_dir(load_config(args.config).model))
    return 0


def _cmd_tenant_create(args: argparse.Namespace) -> int:
    from gateway.api.admin import QuotaIn, SloIn, validate_tenant
    from gateway.errors import ApiError

    slo_in = SloIn(
        ttft_target_ms=args.ttft_target_ms,
        tpot_target_ms=args.tpot_target_ms,
        deadline_s=args.deadline_s,
        allow_rt=args.allow_rt,
    )
    try:
        slo, quota = validate_tenant(
            args.name,
            args.tier,
            slo_in,
            QuotaIn(
                requests_per_min=args.requests_per_min,
                tokens_per_min=args.tokens_per_min,
                max_concurrent=args.max_concurrent,
                monthly_tokens=args.monthly_tokens,
            ),
        )
    except ApiError as exc:
        raise CliError(
            exc.message.replace("slo.", "--").replace("quota.", "--").replace("_", "-")
        ) from None

    async def run(store: Any) -> Any:
        return await store.create_tenant(args.name.strip(), args.tier, slo, quota)

    _print(_with_store(args, run))
    return 0


def _cmd_tenant_list(args: argparse.Namespace) -> int:
    _print(_with_store(args, lambda store: store.list_tenants()))
    return 0


def _cmd_key_create(args: argparse.Namespace) -> int:
    async def run(store: Any) -> Any:
        tenant = await store.get_tenant(args.tenant)
        if tenant is None:
            tenant = next((t for t in await store.list_tenants() if t.name == args.tenant), None)
        if tenant is None:
            raise CliError(f"no tenant with id or name {args.tenant!r}")
        key, secret = await store.create_key(tenant.id, name=args.name)
        return {"id": key.id, "key": secret, "prefix": key.prefix, "tenant_id": tenant.id}

    _print(_with_store(args, run))
    return 0


def _cmd_key_revoke(args: argparse.Namespace) -> int:
    async def run(store: Any) -> Any:
        key = await store.revoke_key(args.key_id)
        if key is None:
            raise CliError(f"no key with id {args.key_id!r}")
        return key

    _print(_with_store(args, run))
    return 0


def _with_store(args: argparse.Namespace, action: Any) -> Any:
    """Runs `action(store)` against the configured database (which must be migrated)."""
    from gateway.store.db import create_engine, session_factory
    from gateway.store.errors import Conflict, NotFound
    from gateway.store.migrate import current_revision, head_revision
    from gateway.store.repo import Store

    config = load_config(args.config)

    async def run() -> Any:
        engine = create_engine(config.database.url)
        try:
            if await current_revision(engine) != head_revision():
                raise CliError("the database is not at the newest schema; run `tandem db upgrade`")
            return await action(Store(session_factory(engine)))
        except (Conflict, NotFound) as exc:
            raise CliError(str(exc)) from None
        finally:
            await engine.dispose()

    try:
        return asyncio.run(run())
    except OSError as exc:
        raise CliError(f"cannot reach the database {_redact(config.database.url)}: {exc}") from None


def _print(payload: Any) -> None:
    print(json.dumps(msgspec.to_builtins(payload), indent=2))


def _redact(url: str) -> str:
    """The URL without its password."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
