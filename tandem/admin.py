"""`tandem admin …`: an operator's command line for a running gateway, over its admin REST API
(`/admin/v1`, gateway/api/admin.py). It never opens the database, so it works from any directory
and against a remote gateway.

    tandem admin tenant create NAME --tier rt|be [contract flags] [quota flags]
    tandem admin tenant list | get TENANT | delete TENANT
    tandem admin tenant update TENANT [--name NEW] [--tier rt|be] [contract flags] [quota flags]
    tandem admin key create TENANT [--name LABEL] | list TENANT | revoke KEY_ID
    tandem admin usage [--tenant TENANT] [--start ISO] [--end ISO] [--group-by day|hour]
                       [--format table|json|csv]

TENANT is a tenant id or name. The gateway is `--url` (default: $TANDEM_URL, else this config's
gateway address); the token is $TANDEM_ADMIN_TOKEN, the one the gateway was started with. Every
failure is one line, `tandem: error: …`: exit status 2 when the request was refused (the API's
own message, with its field names spelled as this command's flags), 1 when the gateway cannot
be reached or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import msgspec

from common.config import ConfigError, admin_token, load_config
from tandem.errors import CliError

URL_ENV = "TANDEM_URL"
"""The gateway's base URL when `--url` is not given (e.g. https://tandem.example.com)."""
PREFIX = "/admin/v1"
TIMEOUT_S = 30.0
"""How long one admin call may take, seconds."""

_UNSET: Any = object()
"""A `tenant update` quota flag that was not given (its default; None means "none")."""
_QUOTA_FLAGS = (
    ("requests_per_min", "requests"),
    ("tokens_per_min", "tokens"),
    ("max_concurrent", "requests in flight"),
    ("monthly_tokens", "tokens per calendar month"),
)
_FLAG_NAMES = {
    "slo.ttft_ms": "--ttft-ms",
    "slo.tpot_ms": "--tpot-ms",
    "slo.deadline_s": "--deadline-s",
    "slo.allow_rt": "--allow-rt",
    "slo.weight": "--weight",
    "slo.on_unattainable": "--on-unattainable",
    "group_by": "--group-by",
    **{f"quota.{name}": "--" + name.replace("_", "-") for name, _ in _QUOTA_FLAGS},
}
"""The API's field names in its error messages → this command's flags, longest first when
applied (so "slo.ttft_ms" is replaced before any shorter name it contains)."""


# -- the command line ---------------------------------------------------------------------------


def add_admin_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Adds `admin` and its objects and actions to the `tandem` command line."""
    conn = argparse.ArgumentParser(add_help=False, parents=[common])
    conn.add_argument(
        "--url",
        help=f"the gateway's base URL (default: ${URL_ENV}, else gateway.host and gateway.port "
        "of the config)",
    )
    admin = subparsers.add_parser(
        "admin",
        help="tenants, contracts, quotas, keys and usage of a running gateway (admin API; "
        "token: $TANDEM_ADMIN_TOKEN)",
    ).add_subparsers(metavar="OBJECT")

    tenant = admin.add_parser("tenant", help="tenants").add_subparsers(metavar="ACTION")
    create = tenant.add_parser("create", parents=[conn], help="create a tenant (JSON)")
    create.add_argument("name")
    create.add_argument("--tier", choices=["rt", "be"], required=True)
    _contract_flags(create, update=False)
    create.set_defaults(func=_entry, action=_tenant_create)
    tenant.add_parser("list", parents=[conn], help="list tenants (JSON)").set_defaults(
        func=_entry, action=_tenant_list
    )
    get = tenant.add_parser("get", parents=[conn], help="one tenant (JSON)")
    get.add_argument("tenant", help="tenant id or name")
    get.set_defaults(func=_entry, action=_tenant_get)
    update = tenant.add_parser(
        "update",
        parents=[conn],
        help="change a tenant's name, tier, contract or quota (flags left out keep their value; "
        "applies at once)",
    )
    update.add_argument("tenant", help="tenant id or name")
    update.add_argument("--name", dest="new_name", help="a new name")
    update.add_argument("--tier", choices=["rt", "be"])
    _contract_flags(update, update=True)
    update.set_defaults(func=_entry, action=_tenant_update)
    delete = tenant.add_parser(
        "delete", parents=[conn], help="delete a tenant (its keys stop working; usage is kept)"
    )
    delete.add_argument("tenant", help="tenant id or name")
    delete.set_defaults(func=_entry, action=_tenant_delete)

    key = admin.add_parser("key", help="API keys").add_subparsers(metavar="ACTION")
    key_create = key.add_parser("create", parents=[conn], help="create a key (shown once)")
    key_create.add_argument("tenant", help="tenant id or name")
    key_create.add_argument("--name", help="a label for the key")
    key_create.set_defaults(func=_entry, action=_key_create)
    key_list = key.add_parser("list", parents=[conn], help="a tenant's keys (JSON, no secrets)")
    key_list.add_argument("tenant", help="tenant id or name")
    key_list.set_defaults(func=_entry, action=_key_list)
    key_revoke = key.add_parser("revoke", parents=[conn], help="revoke a key")
    key_revoke.add_argument("key_id")
    key_revoke.set_defaults(func=_entry, action=_key_revoke)

    filters = argparse.ArgumentParser(add_help=False, parents=[conn])
    filters.add_argument("--tenant", help="tenant id or name (default: all)")
    filters.add_argument(
        "--engine", help="only the requests one engine ran: its name in /readyz (default: all)"
    )
    usage = admin.add_parser(
        "usage",
        parents=[filters],
        help="usage per tenant and day or hour (requests, tokens, latency percentiles, SLO "
        "attainment, errors)",
    )
    usage.add_argument(
        "--start",
        help="ISO date or date-time, UTC if no zone (default: 30 days / 24 hours before --end)",
    )
    usage.add_argument("--end", help="ISO date or date-time, exclusive (default: now)")
    usage.add_argument("--group-by", choices=["day", "hour"], default="day")
    usage.add_argument("--format", choices=["table", "json", "csv"], default="table")
    usage.set_defaults(func=_entry, action=_usage)

    requests = admin.add_parser(
        "requests",
        parents=[filters],
        help="the latest requests, newest first: tenant, tier, status, tokens, latency, SLO, "
        "the engine that ran each",
    )
    requests.add_argument("--limit", type=int, default=20, help="how many (default: 20)")
    requests.add_argument("--format", choices=["table", "json"], default="table")
    requests.set_defaults(func=_entry, action=_requests)


def _contract_flags(parser: argparse.ArgumentParser, *, update: bool) -> None:
    """The SLO contract and quota flags of `tenant create` and `tenant update`."""
    # The flags keep API.md's spelling; the values are targets, so they land in *_target_ms.
    parser.add_argument(
        "--ttft-ms", dest="ttft_target_ms", type=float, help="RT: time-to-first-token target, ms"
    )
    parser.add_argument(
        "--tpot-ms", dest="tpot_target_ms", type=float, help="RT: time-per-output-token target, ms"
    )
    parser.add_argument("--deadline-s", type=float, help="BE: job deadline, seconds")
    parser.add_argument(
        "--allow-rt",
        action=argparse.BooleanOptionalAction if update else "store_true",
        default=None if update else False,
        help="BE tenant may ask for tier rt per request (needs RT targets)",
    )
    parser.add_argument(
        "--on-unattainable",
        choices=["reject", "downgrade", "accept"],
        help="RT requests forecast to miss their targets: refused with 429 (reject, the "
        "default), run as BE (downgrade) or run anyway (accept)",
    )
    parser.add_argument(
        "--weight", type=float, help="weight in the engine's fair share between tenants"
    )
    for name, unit in _QUOTA_FLAGS:
        if update:
            parser.add_argument(
                "--" + name.replace("_", "-"),
                type=_limit,
                default=_UNSET,
                metavar="N|none",
                help=f"quota: {unit} (none: unlimited)",
            )
        else:
            parser.add_argument(
                "--" + name.replace("_", "-"), type=int, help=f"quota: {unit} (default: unlimited)"
            )


def _limit(text: str) -> int | None:
    """A quota flag of `tenant update`: an integer, or "none" for unlimited."""
    if text.strip().lower() in ("none", "null", "unlimited"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or none, got {text!r}") from None


def _entry(args: argparse.Namespace) -> int:
    """Runs one `tandem admin` action against the gateway."""
    return int(args.action(AdminClient(gateway_url(args), _token()), args) or 0)


def gateway_url(args: argparse.Namespace) -> str:
    """`--url`, else $TANDEM_URL, else the config's gateway address (a wildcard host is reached
    on loopback)."""
    url = args.url or os.environ.get(URL_ENV, "").strip()
    if url:
        if not _is_http_url(url):
            raise CliError(f"--url / {URL_ENV} must be a URL like http://host:8000, got {url!r}")
        return str(url)
    gateway = load_config(args.config).gateway
    host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::", "") else gateway.host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{gateway.port}"


def _is_http_url(url: str) -> bool:
    """Whether *url* is an http(s) URL with a host (and a valid port, if any)."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _token() -> str:
    try:
        return admin_token()
    except ConfigError as exc:
        raise CliError(f"{exc} (the admin token the gateway was started with)") from None


# -- the admin API ------------------------------------------------------------------------------


class AdminClient:
    """The admin API of the gateway at *base_url*, with the admin token."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base = base_url.rstrip("/")
        self._token = token

    def call(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> Any:
        """The parsed JSON answer of `/admin/v1` + *path*."""
        raw = self.raw(method, path, payload, query)
        try:
            return json.loads(raw)
        except ValueError:
            raise CliError(
                f"{self.base} answered {method} {PREFIX}{path} with something that is not JSON; "
                "is it a tandem gateway?",
                status=1,
            ) from None

    def raw(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> bytes:
        """The body of the answer of `/admin/v1` + *path*; a refusal or a failure raises a
        one-line `CliError`."""
        url = f"{self.base}{PREFIX}{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        request = urllib.request.Request(
            url,
            data=None if payload is None else json.dumps(payload).encode(),
            method=method,
            headers={
                "Authorization": f"Bearer {self._token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
                return bytes(resp.read())
        except urllib.error.HTTPError as exc:
            raise self._refusal(exc) from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
            raise CliError(
                f"cannot reach the gateway at {self.base}: {reason} (is it running? --url or "
                f"{URL_ENV} names another one)",
                status=1,
            ) from None
        except TimeoutError:
            raise CliError(
                f"the gateway at {self.base} did not answer within {TIMEOUT_S:.0f} s", status=1
            ) from None
        except OSError as exc:
            raise CliError(
                f"talking to the gateway at {self.base} failed: {exc}", status=1
            ) from None

    def _refusal(self, exc: urllib.error.HTTPError) -> CliError:
        message = _api_message(exc)
        if exc.code == 401:
            return CliError(
                f"the gateway at {self.base} refused the admin token ({message or 'unauthorized'}"
                "): set TANDEM_ADMIN_TOKEN to the token it was started with"
            )
        if message is None:
            return CliError(
                f"the gateway at {self.base} answered {exc.code} {exc.reason} (is --url a "
                "tandem gateway?)",
                status=2 if exc.code < 500 else 1,
            )
        if exc.code >= 500:
            return CliError(f"the gateway at {self.base} failed ({exc.code}): {message}", status=1)
        return CliError(_as_flags(message))


def _api_message(exc: urllib.error.HTTPError) -> str | None:
    """The message of the API's OpenAI-style error body (None when there is none)."""
    try:
        body = json.loads(exc.read())
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return None


def _as_flags(message: str) -> str:
    for name in sorted(_FLAG_NAMES, key=len, reverse=True):
        message = message.replace(name, _FLAG_NAMES[name])
    return message


def _print(payload: Any) -> None:
    print(json.dumps(payload, indent=2))


def _find_tenant(client: AdminClient, ident: str) -> dict[str, Any]:
    """The live tenant whose id or name is *ident*."""
    tenants = client.call("GET", "/tenants")["data"]
    for tenant in tenants:
        if tenant["id"] == ident:
            return dict(tenant)
    for tenant in tenants:
        if tenant["name"] == ident:
            return dict(tenant)
    raise CliError(f"no tenant with id or name {ident!r}")


# -- the actions --------------------------------------------------------------------------------


def _slo_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The contract fields given on the command line, by their JSON key."""
    given = {
        "ttft_ms": args.ttft_target_ms,
        "tpot_ms": args.tpot_target_ms,
        "deadline_s": args.deadline_s,
        "allow_rt": args.allow_rt,
        "on_unattainable": args.on_unattainable,
        "weight": args.weight,
    }
    return {k: v for k, v in given.items() if v is not None}


def _tenant_create(client: AdminClient, args: argparse.Namespace) -> int:
    quota = {name: getattr(args, name) for name, _ in _QUOTA_FLAGS}
    body = {
        "name": args.name,
        "tier": args.tier,
        "slo": _slo_fields(args),
        "quota": {k: v for k, v in quota.items() if v is not None},
    }
    _print(client.call("POST", "/tenants", body))
    return 0


def _tenant_list(client: AdminClient, args: argparse.Namespace) -> int:
    _print(client.call("GET", "/tenants")["data"])
    return 0


def _tenant_get(client: AdminClient, args: argparse.Namespace) -> int:
    _print(_find_tenant(client, args.tenant))
    return 0


def _tenant_update(client: AdminClient, args: argparse.Namespace) -> int:
    tenant = _find_tenant(client, args.tenant)
    body: dict[str, Any] = {}
    if args.new_name is not None:
        body["name"] = args.new_name
    if args.tier is not None:
        body["tier"] = args.tier
    slo = _slo_fields(args)
    if slo:
        # the API replaces the whole contract: the fields not given keep their current values
        body["slo"] = {**tenant["slo"], **slo}
    # a quota flag given as "none" is None (unlimited): sent as null; one left out is not sent
    quota = {name: getattr(args, name) for name, _ in _QUOTA_FLAGS}
    quota = {k: v for k, v in quota.items() if v is not _UNSET}
    if quota:
        body["quota"] = quota
    if not body:
        raise CliError("nothing to change: give --name, --tier, a contract or a quota flag")
    _print(client.call("PATCH", f"/tenants/{tenant['id']}", body))
    return 0


def _tenant_delete(client: AdminClient, args: argparse.Namespace) -> int:
    tenant = _find_tenant(client, args.tenant)
    _print(client.call("DELETE", f"/tenants/{tenant['id']}"))
    return 0


def _key_create(client: AdminClient, args: argparse.Namespace) -> int:
    tenant = _find_tenant(client, args.tenant)
    body = {} if args.name is None else {"name": args.name}
    _print(client.call("POST", f"/tenants/{tenant['id']}/keys", body))
    return 0


def _key_list(client: AdminClient, args: argparse.Namespace) -> int:
    tenant = _find_tenant(client, args.tenant)
    _print(client.call("GET", f"/tenants/{tenant['id']}/keys")["data"])
    return 0


def _key_revoke(client: AdminClient, args: argparse.Namespace) -> int:
    _print(client.call("DELETE", f"/keys/{urllib.parse.quote(args.key_id, safe='')}"))
    return 0


def _requests(client: AdminClient, args: argparse.Namespace) -> int:
    tenants = {t["id"]: t["name"] for t in client.call("GET", "/tenants")["data"]}
    query = {"limit": str(args.limit)}
    if args.tenant:
        query["tenant"] = _find_tenant(client, args.tenant)["id"]
    if args.engine:
        query["engine"] = args.engine
    records = client.call("GET", "/requests", query=query)["data"]
    if args.format == "json":
        _print(records)
    else:
        from gateway.reports import requests_table

        print(requests_table(records, tenants))
    return 0


def _usage(client: AdminClient, args: argparse.Namespace) -> int:
    from gateway.reports import UsagePeriod, to_table

    query = {"group_by": args.group_by, "format": "csv" if args.format == "csv" else "json"}
    for name in ("tenant", "engine", "start", "end"):
        if getattr(args, name):
            query[name] = getattr(args, name)
    if args.format == "csv":
        print(client.raw("GET", "/usage", query=query).decode(), end="")
        return 0
    rows = client.call("GET", "/usage", query=query)["data"]
    if args.format == "json":
        _print(rows)
    else:
        print(to_table(msgspec.convert(rows, list[UsagePeriod])))
    return 0
