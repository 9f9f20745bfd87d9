"""Shared fixtures: the store (SQLite and PostgreSQL), the real engine (one per session) and
the gateway in front of it."""

from tests.functional.engine_fixtures import engine_server  # noqa: F401
from tests.functional.gateway_fixtures import (  # noqa: F401
    gateway,
    gateway_without_engine,
    tiny_model_dir,
)
from tests.functional.store_fixtures import (  # noqa: F401
    empty_db_url,
    pg_server,
    store,
    store_engine,
)
