"""SLO admission: slo_contracts.on_unattainable and .weight, usage_records.admission

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27

Written by hand in 0001's style.

* slo_contracts.on_unattainable: what the gateway does with an RT request its admission forecast
  says will miss the contract ("reject", "downgrade" or "accept"); existing contracts get
  "reject", the default of a new one.
* slo_contracts.weight: the tenant's fair-share weight; existing contracts get 1.0.
* usage_records.admission: how the SLO admission treated the request (gateway.store.types
  .AdmissionOutcome); NULL for the rows written before (and for requests it never saw).

The two NOT NULL columns carry a server default so that rows already there get a value (the ORM
writes every value itself, so the default matters only here). Batch mode for SQLite, as in 0004.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("slo_contracts") as batch:
        batch.add_column(
            sa.Column(
                "on_unattainable", sa.String(16), nullable=False, server_default="reject"
            )
        )
        batch.add_column(
            sa.Column("weight", sa.Float(), nullable=False, server_default=sa.text("1.0"))
        )
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("admission", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("admission")
    with op.batch_alter_table("slo_contracts") as batch:
        batch.drop_column("weight")
        batch.drop_column("on_unattainable")
