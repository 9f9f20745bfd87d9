"""The engine that ran each request: usage_records.engine

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29

Written by hand in 0001's style.

With several engines behind one gateway (`engine.replicas`, `engine.endpoints`, SGLang's data
parallelism) an operator asks which replica served a slow or failed request. The column holds
the engine's name as `/readyz` lists it (its URL; `<url>#dp<k>` for one DP rank); NULL for the
rows written before and for requests that never reached an engine. No index of its own: the
request log filtered by engine (`GET /admin/v1/requests?engine=`) walks the created_at index,
and a replica's rows are one in N of the newest (an index would tax every write of this
append-only log for a lookup that is rare). Batch mode for SQLite, as in 0004.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("engine", sa.String(256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("engine")
