"""The console script's access to the gateway's database: migrating it, naming it in messages."""

from __future__ import annotations

from tandem.errors import CliError


def migrate_database(url: str) -> None:
    """Migrates the database at *url* to the newest schema; CliError (status 1) naming the
    database (without its password) and the driver's first line when it cannot be reached or
    migrated."""
    from gateway.store.migrate import upgrade

    try:
        upgrade(url)
    except Exception as exc:  # the drivers raise their own types (asyncpg, sqlite3, OSError)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CliError(
            f"cannot migrate the database {redact_url(url)}: {type(exc).__name__}: {first_line}",
            status=1,
        ) from None


def redact_url(url: str) -> str:
    """The URL without its password."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
