"""quota coordination: gateway_instances, quota_demand, quota_monthly

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21

Written by hand in 0001's style (plain SQLAlchemy types, names from the naming convention).
These tables let several gateway processes sharing one database split every tenant's limits
between them (see gateway/quotas/__init__.py); none of them is read on a request's path.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "gateway_instances",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("started_at", _utc(), nullable=False),
        sa.Column("heartbeat_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_instances")),
    )
    op.create_table(
        "quota_demand",
        sa.Column("instance_id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("requests", sa.Float(), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("concurrency", sa.Float(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False),
        sa.Column("updated_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("instance_id", "tenant_id", name=op.f("pk_quota_demand")),
    )
    op.create_table(
        "quota_monthly",
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("month", sa.String(7), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "month", name=op.f("pk_quota_monthly")),
    )


def downgrade() -> None:
    op.drop_table("quota_monthly")
    op.drop_table("quota_demand")
    op.drop_table("gateway_instances")
