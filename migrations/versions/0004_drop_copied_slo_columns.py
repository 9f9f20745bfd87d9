"""drop usage_records.tbt_mean_ms and slo_contracts.token_group

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25

Written by hand in 0001's style. Two columns nothing needed:

* usage_records.tbt_mean_ms was written as a copy of tpot_ms (the mean gap after the first token
  is TPOT by definition). UsageRecord still reports tbt_mean_ms, derived from tpot_ms.
* slo_contracts.token_group was accepted by the admin API and stored, but neither the SLO verdict
  (gateway/slo.py) nor the scheduler ever read it.

Both drops run in batch mode, which SQLite needs: its ALTER TABLE ... DROP COLUMN (3.35+) is not
in every SQLite Python ships with, and batch mode copies the table instead; on PostgreSQL batch
mode is a plain ALTER TABLE. Downgrade brings both
columns back, nullable: tbt_mean_ms refilled from tpot_ms (so it is exactly what it was),
token_group empty (its values are gone, and nothing ever read them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("tbt_mean_ms")
    with op.batch_alter_table("slo_contracts") as batch:
        batch.drop_column("token_group")


def downgrade() -> None:
    # Columns come back at the end of the table (0001 had them mid-table); nothing reads them by
    # position.
    with op.batch_alter_table("slo_contracts") as batch:
        batch.add_column(sa.Column("token_group", sa.Integer(), nullable=True))
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("tbt_mean_ms", sa.Float(), nullable=True))
    op.execute("UPDATE usage_records SET tbt_mean_ms = tpot_ms")
