"""Usage reports count a request when it finished: indexes on usage_records.finished_at

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27

Written by hand in 0001's style.

The usage report and the dashboard attribute a request's tokens to the period it finished in
(gateway/reports.py): a batch line queued on the engine for minutes counts when it ran, not
when its batch was submitted. Their range scans read `finished_at`, per tenant or for all; the
`created_at` indexes stay for the request log (newest first).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_usage_records_tenant_id_finished_at", "usage_records", ["tenant_id", "finished_at"]
    )
    op.create_index("ix_usage_records_finished_at", "usage_records", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_finished_at", table_name="usage_records")
    op.drop_index("ix_usage_records_tenant_id_finished_at", table_name="usage_records")
