"""The SQL store: tenants, API keys, SLO contracts, quotas, usage records, length history.

SQLAlchemy 2.0 async over SQLite (default) or PostgreSQL (production). Callers use
:class:`Store` and get msgspec Structs back (:mod:`gateway.store.types`), never ORM objects; the
schema is created and changed only by Alembic revisions (:mod:`gateway.store.migrate`).
"""

from gateway.store.db import create_engine, normalize_url, session_factory
from gateway.store.errors import Conflict, NotFound
from gateway.store.migrate import (
    current_revision,
    head_revision,
    is_at_head,
    upgrade,
    upgrade_async,
)
from gateway.store.repo import Store
from gateway.store.types import ApiKey, AuthRecord, Quota, Slo, Tenant, UsageRecord

__all__ = [
    "ApiKey",
    "AuthRecord",
    "Conflict",
    "NotFound",
    "Quota",
    "Slo",
    "Store",
    "Tenant",
    "UsageRecord",
    "create_engine",
    "current_revision",
    "head_revision",
    "is_at_head",
    "normalize_url",
    "session_factory",
    "upgrade",
    "upgrade_async",
]
