"""`tandem admin usage`: the usage report of GET /admin/v1/usage, printed as a table (or JSON/CSV)
straight from the configured database."""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import msgspec

from common.config import load_config
from gateway.reports import BadQuery, parse_query, to_csv, to_table, usage_report
from tandem.errors import CliError


def add_usage_command(admin: Any, common: argparse.ArgumentParser) -> None:
    """Adds `usage` to the `tandem admin` sub-commands."""
    usage = admin.add_parser(
        "usage",
        parents=[common],
        help="usage per tenant and day or hour (requests, tokens, latency "
        "percentiles, SLO attainment, errors)",
    )
    usage.add_argument("--tenant", help="tenant id or name (default: all)")
    usage.add_argument(
        "--start",
        help="ISO date or date-time, UTC if no zone (default: 30 days / 24 hours before --end)",
    )
    usage.add_argument("--end", help="ISO date or date-time, exclusive (default: now)")
    usage.add_argument("--group-by", choices=["day", "hour"], default="day")
    usage.add_argument("--format", choices=["table", "json", "csv"], default="table")
    usage.set_defaults(func=_cmd_usage)


def _cmd_usage(args: argparse.Namespace) -> int:
    params = {
        "start": args.start or "",
        "end": args.end or "",
        "group_by": args.group_by,
        "format": args.format,
    }
    try:
        query = parse_query(params, datetime.now(UTC), formats=("table", "json", "csv"))
    except BadQuery as exc:
        raise CliError(str(exc).replace("group_by", "--group-by")) from None
    config = load_config(args.config)
    rows = asyncio.run(
        _report(config.database.url, query.start, query.end, query.bucket_s, args.tenant)
    )
    if query.format == "json":
        print(json.dumps(msgspec.to_builtins(rows), indent=2))
    elif query.format == "csv":
        print(to_csv(rows), end="")
    else:
        print(to_table(rows))
    return 0


async def _report(
    url: str, start: datetime, end: datetime, bucket_s: int, tenant: str | None
) -> Any:
    from gateway.store.db import create_engine, session_factory
    from gateway.store.migrate import current_revision, head_revision
    from gateway.store.repo import Store

    engine = create_engine(url)
    try:
        try:
            revision = await current_revision(engine)
        except OSError as exc:
            raise CliError(f"cannot reach the database: {exc}") from None
        if revision != head_revision():
            raise CliError("the database is not at the newest schema; run `tandem db upgrade`")
        tenant_id = None
        if tenant is not None:
            store = Store(session_factory(engine))
            found = await store.get_tenant(tenant, include_deleted=True)
            if found is None:
                named = [
                    t for t in await store.list_tenants(include_deleted=True) if t.name == tenant
                ]
                if not named:
                    raise CliError(f"no tenant with id or name {tenant!r}")
                found = named[-1]
            tenant_id = found.id
        return await usage_report(engine, start, end, bucket_s, tenant_id)
    finally:
        await engine.dispose()
