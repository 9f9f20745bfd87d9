"""ORM tables (SQLAlchemy 2.0 declarative). Only the store's repo and the migrations import this.

Portable across SQLite and PostgreSQL: no server-side defaults or types either lacks, timestamps
through :class:`UtcDateTime`, and 64-bit autoincrement ids that SQLite can still autoincrement.
The schema itself is created by Alembic (migrations/versions); keep the two in step.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Named constraints, so later Alembic revisions can drop or alter them by name (SQLite's batch
# mode needs names too).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite autoincrements only a column declared exactly INTEGER PRIMARY KEY.
BigIntId = BigInteger().with_variant(Integer, "sqlite")


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on both databases.

    PostgreSQL stores `timestamptz`; SQLite stores text without an offset, so values are converted
    to UTC on the way in and given the UTC zone on the way out. One zone for every stored value
    also keeps SQLite's fixed-width text sortable, which ORDER BY created_at relies on. Naive
    datetimes are refused: they are a bug at the call site, not something to guess about.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} given to the store; use UTC")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base holding the metadata Alembic compares against."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UtcDateTime()}


class TenantRow(Base):
    """tenants: soft-deleted (deleted_at) so usage stays attributable."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    deleted_at: Mapped[datetime | None]

    # Always loaded with the tenant (one query, no lazy loads under asyncio).
    slo: Mapped[SloContractRow | None] = relationship(lazy="joined", cascade="all, delete-orphan")
    quota: Mapped[QuotaRow | None] = relationship(lazy="joined", cascade="all, delete-orphan")

    __table_args__ = (
        # Unique among live tenants only: a deleted tenant's name may be reused.
        Index(
            "uq_tenants_name_live",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
    )


class ApiKeyRow(Base):
    """api_keys: the prefix and SHA-256 of each key, never the secret."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]

    tenant: Mapped[TenantRow] = relationship(lazy="joined", innerjoin=True)


class SloContractRow(Base):
    """slo_contracts: one contract per tenant.

    The targets are *_target_ms in Python, like the Slo Struct, while the columns keep their
    original names ttft_ms / tpot_ms (renaming them would be a migration for no reader's gain).
    """

    __tablename__ = "slo_contracts"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    ttft_target_ms: Mapped[float | None] = mapped_column("ttft_ms", Float)
    tpot_target_ms: Mapped[float | None] = mapped_column("tpot_ms", Float)
    deadline_s: Mapped[float | None] = mapped_column(Float)
    allow_rt: Mapped[bool] = mapped_column(Boolean, default=False)
    on_unattainable: Mapped[str] = mapped_column(String(16), default="reject")
    """"reject", "downgrade" or "accept" (gateway.store.types.OnUnattainable)."""
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    """The tenant's fair-share weight (> 0)."""
    updated_at: Mapped[datetime]


class QuotaRow(Base):
    """quotas: one row per tenant; NULL means unlimited."""

    __tablename__ = "quotas"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    requests_per_min: Mapped[int | None] = mapped_column(Integer)
    tokens_per_min: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    monthly_tokens: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime]


class UsageRow(Base):
    """usage_records: one row per request.

    tenant_id and key_id carry no foreign keys on purpose: this is an append-only log written in
    bulk off the hot path, and one stale id must not make a batch of hundreds fail. Tenants and
    keys are never hard-deleted, so the ids stay resolvable.
    """

    __tablename__ = "usage_records"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128))
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(32))
    tier: Mapped[str] = mapped_column(String(8))
    model: Mapped[str] = mapped_column(String(256))
    endpoint: Mapped[str] = mapped_column(String(32))
    stream: Mapped[bool] = mapped_column(Boolean)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tbt_max_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(32))
    http_status: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    slo_met: Mapped[bool | None] = mapped_column(Boolean)
    admission: Mapped[str | None] = mapped_column(String(16))
    """The SLO admission's outcome (gateway.store.types.AdmissionOutcome); NULL: not checked."""
    engine: Mapped[str | None] = mapped_column(String(256))
    """The engine that ran it (gateway.store.types.UsageRecord.engine); NULL: none."""
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime]

    __table_args__ = (
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_usage_records_created_at", "created_at"),
        # the usage report counts a request in the period it finished (gateway/reports.py)
        Index("ix_usage_records_tenant_id_finished_at", "tenant_id", "finished_at"),
        Index("ix_usage_records_finished_at", "finished_at"),
    )


class LengthHistoryRow(Base):
    """length_history: finished output lengths per key, newest = highest id, windowed."""

    __tablename__ = "length_history"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    length_key: Mapped[str] = mapped_column(String(200))
    output_len: Mapped[int] = mapped_column(Integer)
    prompt_len: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]

    __table_args__ = (Index("ix_length_history_length_key_id", "length_key", "id"),)


class FileRow(Base):
    """files: uploaded JSONL inputs (purpose ``batch``) and the batch runner's output/error files.

    The content lives in the row, so a file is exactly as durable as the database and needs no
    shared disk between gateway processes; upload size is capped by the gateway's file limits.
    ``line_count`` is the number of non-empty lines (None for files that are not JSONL).
    """

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column("bytes", BigInteger)
    line_count: Mapped[int | None] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]


class BatchRow(Base):
    """batches: one OpenAI batch job; the per-line state lives in batch_items.

    Timestamps follow OpenAI's batch object (one per status reached). ``deadline_at`` is when the
    tenant needs the batch done (completion window shorter than 24 h, or the tenant's BE
    ``deadline_s``); it is passed to the engine with every line. ``errors`` is a JSON list of
    batch-level errors; ``metadata_json`` the client's metadata object as JSON.
    """

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    key_id: Mapped[str | None] = mapped_column(String(32))
    """The API key that created the batch (its lines' usage records name it)."""
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(256))
    output_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    errors: Mapped[str | None] = mapped_column(Text)
    metadata_json: Mapped[str | None] = mapped_column(Text)
    request_total: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    deadline_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    expires_at: Mapped[datetime]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]

    __table_args__ = (
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        # The runner's scan for work: batches not yet in a final status.
        Index("ix_batches_status", "status"),
    )


class BatchItemRow(Base):
    """batch_items: one row per JSONL line of a batch's input, with its status.

    Unique (batch_id, custom_id) and (batch_id, line_no): a line exists once, so a restart can
    only resume it, never duplicate it. ``order_rank`` is the line's place in the runner's
    resource-aware order (NULL until the batch is planned). ``response``/``error`` hold the
    output-file and error-file objects for the line as JSON. ``attempts`` counts the line's
    tries, each counted as the line is taken to run, before its request is sent (so one the
    engine or the gateway did not survive still counts, across restarts), and given back when
    the engine turned out unreachable; `batch.max_attempts` bounds it.
    """

    __tablename__ = "batch_items"

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"))
    line_no: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    method: Mapped[str] = mapped_column(String(8))
    url: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    order_rank: Mapped[int | None] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_batch_id_custom_id"),
        UniqueConstraint("batch_id", "line_no", name="uq_batch_items_batch_id_line_no"),
        # The runner's next-lines query: pending lines of a batch in planned order.
        Index("ix_batch_items_batch_id_status_order_rank", "batch_id", "status", "order_rank"),
    )


class GatewayInstanceRow(Base):
    """gateway_instances: the gateway processes sharing this database, with a heartbeat.

    Quota enforcement (gateway.quotas) splits every tenant's limits among the live instances;
    an instance whose heartbeat is older than the quota timeout no longer counts.
    """

    __tablename__ = "gateway_instances"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]


class QuotaDemandRow(Base):
    """quota_demand: one gateway instance's recent demand for one tenant's limits.

    Every instance writes its own rows at each quota sync and reads everyone's, so all instances
    compute the same split of each limit (gateway.quotas.shares).
    """

    __tablename__ = "quota_demand"

    instance_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    requests: Mapped[float] = mapped_column(Float)
    tokens: Mapped[float] = mapped_column(Float)
    concurrency: Mapped[float] = mapped_column(Float)
    in_flight: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime]


class QuotaMonthlyRow(Base):
    """quota_monthly: tokens used by a tenant in one calendar month (UTC), across all instances.

    Instances add what their finished requests used (an atomic upsert-increment at each sync), so
    the monthly budget holds no matter which instance served a request.
    """

    __tablename__ = "quota_monthly"

    tenant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    month: Mapped[str] = mapped_column(String(7), primary_key=True)
    """"YYYY-MM" (UTC)."""
    tokens: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime]
