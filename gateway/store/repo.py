"""The store's repository: every public method is one short transaction and returns Structs."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Table, bindparam, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from common.wire import Tier
from gateway.keys import generate_key
from gateway.store.convert import (
    USAGE_FIELDS,
    api_key_struct,
    apply_quota,
    apply_slo,
    tenant_struct,
    usage_struct,
)
from gateway.store.db import uninterrupted
from gateway.store.errors import Conflict, NotFound
from gateway.store.models import (
    ApiKeyRow,
    LengthHistoryRow,
    QuotaRow,
    SloContractRow,
    TenantRow,
    UsageRow,
)
from gateway.store.types import ApiKey, AuthRecord, Quota, Slo, Tenant, UsageRecord

_TIERS = ("rt", "be")
_length_table = cast(Table, LengthHistoryRow.__table__)


def _now() -> datetime:
    return datetime.now(UTC)


def _new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(6)}"


class Store:
    """Async access to tenants, keys, usage and length history.

    Built from a session factory (:func:`gateway.store.db.session_factory`); holds no state of its
    own, so one instance may be shared by every handler and background task.
    """

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    # ------------------------------------------------------------------ tenants

    @uninterrupted
    async def create_tenant(self, name: str, tier: Tier, slo: Slo, quota: Quota) -> Tenant:
        """Creates a tenant with its contract and quota. Raises Conflict if *name* is taken."""
        _check_tier(tier)
        now = _now()
        row = TenantRow(id=_new_id("ten"), name=name, tier=tier, created_at=now, updated_at=now)
        row.slo = SloContractRow(updated_at=now)
        row.quota = QuotaRow(updated_at=now)
        apply_slo(row.slo, slo)
        apply_quota(row.quota, quota)
        try:
            async with self._sessions.begin() as session:
                session.add(row)
        except IntegrityError:
            raise Conflict(f"a tenant named {name!r} already exists") from None
        return tenant_struct(row)

    async def get_tenant(self, tenant_id: str, *, include_deleted: bool = False) -> Tenant | None:
        """The tenant, or None if unknown or (unless *include_deleted*) deleted."""
        async with self._sessions() as session:
            row = await session.get(TenantRow, tenant_id)
            if row is None or (row.deleted_at is not None and not include_deleted):
                return None
            return tenant_struct(row)

    async def list_tenants(self, *, include_deleted: bool = False) -> list[Tenant]:
        """Live tenants (all with *include_deleted*), oldest first."""
        stmt = select(TenantRow).order_by(TenantRow.created_at, TenantRow.id)
        if not include_deleted:
            stmt = stmt.where(TenantRow.deleted_at.is_(None))
        async with self._sessions() as session:
            rows = (await session.scalars(stmt)).unique().all()
            return [tenant_struct(r) for r in rows]

    @uninterrupted
    async def update_tenant(
        self,
        tenant_id: str,
        *,
        name: str | None = None,
        tier: Tier | None = None,
        slo: Slo | None = None,
        quota: Quota | None = None,
    ) -> Tenant | None:
        """Changes the given fields of a live tenant; *slo* / *quota* replace the whole contract /
        quota. None if the tenant is unknown or deleted; Conflict if *name* is taken."""
        if tier is not None:
            _check_tier(tier)
        now = _now()
        try:
            async with self._sessions.begin() as session:
                row = await session.get(TenantRow, tenant_id)
                if row is None or row.deleted_at is not None:
                    return None
                if name is not None:
                    row.name = name
                if tier is not None:
                    row.tier = tier
                if slo is not None:
                    row.slo = row.slo or SloContractRow(tenant_id=tenant_id)
                    apply_slo(row.slo, slo)
                    row.slo.updated_at = now
                if quota is not None:
                    row.quota = row.quota or QuotaRow(tenant_id=tenant_id)
                    apply_quota(row.quota, quota)
                    row.quota.updated_at = now
                row.updated_at = now
        except IntegrityError:
            raise Conflict(f"a tenant named {name!r} already exists") from None
        return tenant_struct(row)

    @uninterrupted
    async def delete_tenant(self, tenant_id: str) -> bool:
        """Soft-deletes a live tenant and revokes all its keys. False if unknown or already
        deleted. Its usage records stay, attributed to its id."""
        now = _now()
        async with self._sessions.begin() as session:
            result = await session.execute(
                update(TenantRow)
                .where(TenantRow.id == tenant_id, TenantRow.deleted_at.is_(None))
                .values(deleted_at=now, updated_at=now)
            )
            if _rowcount(result) == 0:
                return False
            await session.execute(
                update(ApiKeyRow)
                .where(ApiKeyRow.tenant_id == tenant_id, ApiKeyRow.revoked_at.is_(None))
                .values(revoked_at=now)
            )
            return True

    # --------------------------------------------------------------------- keys

    @uninterrupted
    async def create_key(self, tenant_id: str, name: str | None = None) -> tuple[ApiKey, str]:
        """Creates a key for a live tenant: (its record, the full key). The full key is returned
        only here and never stored. Raises NotFound for an unknown or deleted tenant."""
        material = generate_key()
        async with self._sessions.begin() as session:
            tenant = await session.get(TenantRow, tenant_id)
            if tenant is None or tenant.deleted_at is not None:
                raise NotFound(f"tenant {tenant_id!r} not found")
            row = ApiKeyRow(
                id=_new_id("key"),
                tenant_id=tenant_id,
                prefix=material.prefix,
                secret_sha256=material.sha256,
                name=name,
                created_at=_now(),
            )
            session.add(row)
        return api_key_struct(row), material.key

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """All keys of a tenant, revoked ones included, oldest first ([] for an unknown id)."""
        stmt = (
            select(ApiKeyRow)
            .where(ApiKeyRow.tenant_id == tenant_id)
            .order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        )
        async with self._sessions() as session:
            return [api_key_struct(r) for r in (await session.scalars(stmt)).unique().all()]

    @uninterrupted
    async def revoke_key(self, key_id: str) -> ApiKey | None:
        """Revokes a key (a revoked key keeps its first revocation time); None if unknown."""
        async with self._sessions.begin() as session:
            row = await session.get(ApiKeyRow, key_id)
            if row is None:
                return None
            if row.revoked_at is None:
                row.revoked_at = _now()
            return api_key_struct(row)

    async def lookup_key(self, prefix: str) -> AuthRecord | None:
        """The key with *prefix*, its tenant, contract and quota (one query); None if unknown.

        Revoked keys and keys of deleted tenants are returned with ``revoked=True`` so the caller
        can tell them apart from unknown ones in its logs.
        """
        # ApiKeyRow.tenant and the tenant's slo/quota are joined-eager: one SELECT with joins.
        stmt = select(ApiKeyRow).where(ApiKeyRow.prefix == prefix)
        async with self._sessions() as session:
            row = (await session.scalars(stmt)).unique().one_or_none()
            if row is None:
                return None
            return AuthRecord(
                key_id=row.id,
                prefix=row.prefix,
                secret_sha256=row.secret_sha256,
                revoked=row.revoked_at is not None or row.tenant.deleted_at is not None,
                tenant=tenant_struct(row.tenant),
            )

    @uninterrupted
    async def touch_keys(self, key_ids: Iterable[str], when: datetime) -> None:
        """Sets last_used_at = *when* on the given keys (one UPDATE); never moves it backwards."""
        ids = sorted(set(key_ids))
        if not ids:
            return
        async with self._sessions.begin() as session:
            await session.execute(
                update(ApiKeyRow)
                .where(
                    ApiKeyRow.id.in_(ids),
                    (ApiKeyRow.last_used_at.is_(None)) | (ApiKeyRow.last_used_at < when),
                )
                .values(last_used_at=when)
            )

    # -------------------------------------------------------------------- usage

    @uninterrupted
    async def insert_usage(self, records: Sequence[UsageRecord]) -> None:
        """Writes the records in one bulk INSERT (their ``id`` fields are ignored)."""
        if not records:
            return
        rows = [{f.name: getattr(r, f.name) for f in USAGE_FIELDS} for r in records]
        async with self._sessions.begin() as session:
            await session.execute(insert(UsageRow), rows)

    async def latest_requests(
        self, tenant_id: str | None, limit: int, engine: str | None = None
    ) -> list[UsageRecord]:
        """The newest *limit* usage records (of one tenant, or of all with None; of one engine
        with *engine*), newest first."""
        stmt = select(UsageRow).order_by(UsageRow.created_at.desc(), UsageRow.id.desc())
        if tenant_id is not None:
            stmt = stmt.where(UsageRow.tenant_id == tenant_id)
        if engine is not None:
            stmt = stmt.where(UsageRow.engine == engine)
        async with self._sessions() as session:
            rows = (await session.scalars(stmt.limit(max(limit, 0)))).all()
            return [usage_struct(r) for r in rows]

    # ----------------------------------------------------------- length history

    @uninterrupted
    async def append_lengths(
        self, rows: Sequence[tuple[str, int, int | None]], window: int
    ) -> None:
        """Appends (length_key, output_len, prompt_len) rows, then keeps only the newest *window*
        rows of every key touched, all in one transaction.

        Two appends to one key running at once on PostgreSQL may each miss the other's rows while
        pruning, leaving a few extra until the next append; readers pass a limit, so it is
        harmless."""
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if not rows:
            return
        now = _now()
        values = [
            {"length_key": k, "output_len": out, "prompt_len": p, "created_at": now}
            for k, out, p in rows
        ]
        t = _length_table
        # Per key: delete every row older than the window-th newest. When the key has fewer than
        # `window` rows the subquery is NULL, `id < NULL` is never true, and nothing is deleted.
        # Plain LIMIT/OFFSET in a scalar subquery works on SQLite and PostgreSQL alike, and the
        # (length_key, id) index serves both the subquery and the range delete.
        cutoff = (
            select(t.c.id)
            .where(t.c.length_key == bindparam("key"))
            .order_by(t.c.id.desc())
            .offset(window - 1)
            .limit(1)
            .scalar_subquery()
        )
        prune = delete(t).where(t.c.length_key == bindparam("key"), t.c.id < cutoff)
        async with self._sessions.begin() as session:
            await session.execute(insert(t), values)
            await session.execute(prune, [{"key": k} for k in sorted({r[0] for r in rows})])

    async def length_history(self, length_key: str, limit: int) -> list[int]:
        """The newest *limit* output lengths of *length_key*, in order (newest last)."""
        t = _length_table
        stmt = (
            select(t.c.output_len)
            .where(t.c.length_key == length_key)
            .order_by(t.c.id.desc())
            .limit(max(limit, 0))
        )
        async with self._sessions() as session:
            lengths = list((await session.scalars(stmt)).all())
        lengths.reverse()
        return lengths

    async def length_keys_changed(self, after_id: int) -> tuple[set[str], int]:
        """The keys with a length row newer than *after_id*, and the newest row id (or
        *after_id* when none is newer): what a sync has to re-send."""
        t = _length_table
        stmt = (
            select(t.c.length_key, func.max(t.c.id))
            .where(t.c.id > after_id)
            .group_by(t.c.length_key)
        )
        async with self._sessions() as session:
            rows = (await session.execute(stmt)).all()
        newest = max((int(row[1]) for row in rows), default=after_id)
        return {str(row[0]) for row in rows}, newest

    async def length_histories(
        self, keys: Iterable[str], limit_per_key: int
    ) -> dict[str, list[int]]:
        """The newest *limit_per_key* output lengths (newest last) of each of *keys*."""
        return {key: await self.length_history(key, limit_per_key) for key in sorted(set(keys))}


# ----------------------------------------------------------------- helpers


def _check_tier(tier: str) -> None:
    if tier not in _TIERS:
        raise ValueError(f"tier must be 'rt' or 'be', got {tier!r}")


def _rowcount(result: Any) -> int:
    # CursorResult.rowcount; typed loosely because session.execute() returns Result.
    return int(result.rowcount)
