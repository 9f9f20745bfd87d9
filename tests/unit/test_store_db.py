"""Unit tests of the store's pure parts: URL normalisation, timestamp handling, Struct encoding."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

import msgspec
import pytest
from sqlalchemy.dialects import sqlite

from gateway.store import ApiKey, Slo, UsageRecord, head_revision, normalize_url
from gateway.store.models import UtcDateTime


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///tandem.db", "sqlite+aiosqlite:///tandem.db"),
        ("sqlite:////abs/path/t.db", "sqlite+aiosqlite:////abs/path/t.db"),
        ("sqlite+aiosqlite:///tandem.db", "sqlite+aiosqlite:///tandem.db"),
        ("sqlite://", "sqlite+aiosqlite://"),
        ("postgresql://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"),
        ("postgres://u@h/db?ssl=require", "postgresql+asyncpg://u@h/db?ssl=require"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
    ],
)
def test_normalize_url_gives_the_async_driver(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


def test_normalize_url_keeps_special_characters_of_the_password() -> None:
    assert normalize_url("postgresql://u:p%40ss@h/db") == "postgresql+asyncpg://u:p%40ss@h/db"


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("mysql://u@h/db", "'mysql'"),
        ("oracle+cx_oracle://h", "'oracle+cx_oracle'"),
        ("sqlite+pysqlite:///x.db", "'sqlite+pysqlite'"),
        ("postgresql+psycopg2://u@h/db", "'postgresql+psycopg2'"),
    ],
)
def test_normalize_url_rejects_other_schemes_naming_them(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        normalize_url(url)


def test_normalize_url_rejects_a_url_without_scheme() -> None:
    with pytest.raises(ValueError, match="no scheme"):
        normalize_url("tandem.db")


def test_timestamps_are_stored_as_utc_and_read_back_aware() -> None:
    column = UtcDateTime()
    dialect = sqlite.dialect()
    paris = datetime(2026, 1, 1, 13, 0, tzinfo=timezone(timedelta(hours=1)))
    stored = column.process_bind_param(paris, dialect)
    assert stored == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert stored is not None and stored.utcoffset() == timedelta(0)
    # SQLite hands back naive values; they are UTC.
    read = column.process_result_value(datetime(2026, 1, 1, 12, 0), dialect)
    assert read == datetime(2026, 1, 1, 12, 0, tzinfo=UTC) and read.tzinfo is UTC


def test_naive_timestamps_are_refused() -> None:
    with pytest.raises(ValueError, match="naive datetime"):
        UtcDateTime().process_bind_param(datetime(2026, 1, 1), sqlite.dialect())


def test_structs_encode_datetimes_as_iso_8601() -> None:
    when = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    key = ApiKey(id="key_1", tenant_id="ten_1", prefix="abc", created_at=when)
    decoded = msgspec.json.decode(msgspec.json.encode(key))
    assert decoded["created_at"] == "2026-03-04T05:06:07Z"
    assert decoded["revoked_at"] is None


def test_usage_record_needs_only_the_essential_fields() -> None:
    now = datetime.now(UTC)
    record = UsageRecord(
        request_id="r1",
        tenant_id="ten_1",
        tier="be",
        model="m",
        endpoint="chat",
        status="ok",
        http_status=200,
        created_at=now,
        finished_at=now,
    )
    assert record.id is None and record.prompt_tokens == 0 and record.slo_met is None


def test_usage_record_mean_tbt_is_tpot_whatever_was_passed() -> None:
    # usage_records has no tbt_mean_ms column (migration 0004); the API still reports it.
    now = datetime.now(UTC)
    record = UsageRecord(
        request_id="r1",
        tenant_id="ten_1",
        tier="rt",
        model="m",
        endpoint="chat",
        tpot_ms=21.0,
        status="ok",
        http_status=200,
        created_at=now,
        finished_at=now,
    )
    assert record.tbt_mean_ms == 21.0
    assert msgspec.structs.replace(record, tpot_ms=30.0).tbt_mean_ms == 30.0
    assert msgspec.structs.replace(record, tbt_mean_ms=99.0).tbt_mean_ms == 21.0
    decoded = msgspec.json.decode(msgspec.json.encode(record), type=UsageRecord)
    assert (
        decoded == record
        and msgspec.json.decode(msgspec.json.encode(record))["tbt_mean_ms"] == 21.0
    )


def test_slo_targets_keep_their_json_keys() -> None:
    slo = Slo(ttft_target_ms=200.0, tpot_target_ms=50.0)
    assert msgspec.json.decode(msgspec.json.encode(slo)) == {
        "ttft_ms": 200.0,
        "tpot_ms": 50.0,
        "deadline_s": None,
        "allow_rt": False,
        "on_unattainable": "reject",
        "weight": 1.0,
    }
    assert msgspec.json.decode(b'{"ttft_ms": 1, "tpot_ms": 2}', type=Slo) == Slo(
        ttft_target_ms=1.0, tpot_target_ms=2.0
    )


def test_head_revision_is_read_from_the_migrations_folder() -> None:
    from pathlib import Path

    versions = Path(__file__).resolve().parents[2] / "migrations" / "versions"
    newest = max(p.name.split("_", 1)[0] for p in versions.glob("[0-9]*_*.py"))
    assert head_revision() == newest == "0007"
