"""batch API: files, batches, batch_items

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21

Written by hand in 0001's style: plain SQLAlchemy types only, constraint names from the naming
convention in gateway/store/models.py. One batch_items row per JSONL line, unique per
(batch, custom_id) and (batch, line number), so a restarted runner resumes lines and never
duplicates them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def _big_id() -> sa.types.TypeEngine[int]:
    # SQLite autoincrements only INTEGER PRIMARY KEY; PostgreSQL gets BIGINT (identity/serial).
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("expires_at", _utc(), nullable=True),
        sa.Column("deleted_at", _utc(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_files_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index(op.f("ix_files_tenant_id"), "files", ["tenant_id"])

    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("key_id", sa.String(32), nullable=True),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        sa.Column("errors", sa.Text(), nullable=True),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("request_total", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("deadline_at", _utc(), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("in_progress_at", _utc(), nullable=True),
        sa.Column("expires_at", _utc(), nullable=False),
        sa.Column("finalizing_at", _utc(), nullable=True),
        sa.Column("completed_at", _utc(), nullable=True),
        sa.Column("failed_at", _utc(), nullable=True),
        sa.Column("expired_at", _utc(), nullable=True),
        sa.Column("cancelling_at", _utc(), nullable=True),
        sa.Column("cancelled_at", _utc(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_batches_tenant_id_tenants")
        ),
        sa.ForeignKeyConstraint(
            ["input_file_id"], ["files.id"], name=op.f("fk_batches_input_file_id_files")
        ),
        sa.ForeignKeyConstraint(
            ["output_file_id"], ["files.id"], name=op.f("fk_batches_output_file_id_files")
        ),
        sa.ForeignKeyConstraint(
            ["error_file_id"], ["files.id"], name=op.f("fk_batches_error_file_id_files")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_tenant_id_created_at", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])

    op.create_table(
        "batch_items",
        sa.Column("id", _big_id(), autoincrement=True, nullable=False),
        sa.Column("batch_id", sa.String(40), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("url", sa.String(64), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("order_rank", sa.Integer(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", _utc(), nullable=True),
        sa.Column("finished_at", _utc(), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_batch_items_batch_id_batches")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_items")),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_batch_id_custom_id"),
        sa.UniqueConstraint("batch_id", "line_no", name="uq_batch_items_batch_id_line_no"),
    )
    op.create_index(
        "ix_batch_items_batch_id_status_order_rank",
        "batch_items",
        ["batch_id", "status", "order_rank"],
    )


def downgrade() -> None:
    op.drop_index("ix_batch_items_batch_id_status_order_rank", table_name="batch_items")
    op.drop_table("batch_items")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_id_created_at", table_name="batches")
    op.drop_table("batches")
    op.drop_index(op.f("ix_files_tenant_id"), table_name="files")
    op.drop_table("files")
