"""Conversions between ORM rows and the Structs the store returns (no I/O here)."""

from __future__ import annotations

from typing import cast

import msgspec

from common.wire import Tier
from gateway.store.models import ApiKeyRow, QuotaRow, SloContractRow, TenantRow, UsageRow
from gateway.store.types import ApiKey, OnUnattainable, Quota, Slo, Tenant, UsageRecord

USAGE_FIELDS = tuple(
    f for f in msgspec.structs.fields(UsageRecord) if f.name not in ("id", "tbt_mean_ms")
)
"""The usage_records columns a UsageRecord carries, in order (the row id is assigned on insert;
tbt_mean_ms is derived from tpot_ms, not stored)."""


def apply_slo(row: SloContractRow, slo: Slo) -> None:
    """Copies every contract field of *slo* onto *row* (a whole-row replacement)."""
    row.ttft_target_ms = slo.ttft_target_ms
    row.tpot_target_ms = slo.tpot_target_ms
    row.deadline_s = slo.deadline_s
    row.allow_rt = slo.allow_rt
    row.on_unattainable = slo.on_unattainable
    row.weight = slo.weight


def apply_quota(row: QuotaRow, quota: Quota) -> None:
    """Copies every limit of *quota* onto *row* (a whole-row replacement)."""
    row.requests_per_min = quota.requests_per_min
    row.tokens_per_min = quota.tokens_per_min
    row.max_concurrent = quota.max_concurrent
    row.monthly_tokens = quota.monthly_tokens


def _float(value: float | None) -> float | None:
    # Before a round trip the row holds what the caller passed (possibly an int); the Struct
    # must look the same whether it came from an insert or a read.
    return None if value is None else float(value)


def tenant_struct(row: TenantRow) -> Tenant:
    """The Struct of a tenant row whose slo and quota are loaded (missing rows: defaults)."""
    slo = (
        Slo()
        if row.slo is None
        else Slo(
            ttft_target_ms=_float(row.slo.ttft_target_ms),
            tpot_target_ms=_float(row.slo.tpot_target_ms),
            deadline_s=_float(row.slo.deadline_s),
            allow_rt=row.slo.allow_rt,
            on_unattainable=cast(OnUnattainable, row.slo.on_unattainable),
            weight=float(row.slo.weight),
        )
    )
    quota = (
        Quota()
        if row.quota is None
        else Quota(
            requests_per_min=row.quota.requests_per_min,
            tokens_per_min=row.quota.tokens_per_min,
            max_concurrent=row.quota.max_concurrent,
            monthly_tokens=row.quota.monthly_tokens,
        )
    )
    return Tenant(
        id=row.id,
        name=row.name,
        tier=cast(Tier, row.tier),
        slo=slo,
        quota=quota,
        created_at=row.created_at,
        updated_at=row.updated_at,
        deleted=row.deleted_at is not None,
    )


def api_key_struct(row: ApiKeyRow) -> ApiKey:
    """The public part of a key row."""
    return ApiKey(
        id=row.id,
        tenant_id=row.tenant_id,
        prefix=row.prefix,
        name=row.name,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )


def usage_struct(row: UsageRow) -> UsageRecord:
    """A usage row as a Struct, with its id."""
    fields = {f.name: getattr(row, f.name) for f in USAGE_FIELDS}
    return UsageRecord(id=row.id, **fields)
