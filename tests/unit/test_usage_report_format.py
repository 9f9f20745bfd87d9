"""The usage report's parameters, CSV and terminal table (pure; the SQL is tested against real
databases in tests/functional/test_usage_report.py)."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import pytest

from gateway.reports import COLUMNS, BadQuery, UsagePeriod, parse_query, to_csv, to_table

NOW = datetime(2026, 11, 21, 12, 30, tzinfo=UTC)


def period(**overrides: object) -> UsagePeriod:
    fields: dict[str, object] = dict(
        period_start=datetime(2026, 11, 20, tzinfo=UTC),
        tenant_id="ten_1",
        tenant_name="acme",
        requests=10,
        prompt_tokens=100,
        completion_tokens=50,
        total_tokens=150,
        errors=2,
        rate_limited=1,
        ttft_ms_p50=120.5,
        ttft_ms_p99=300.0,
        tpot_ms_p50=None,
        tpot_ms_p99=None,
        slo_met=6,
        slo_judged=8,
        slo_attainment=0.75,
    )
    fields.update(overrides)
    return UsagePeriod(**fields)  # type: ignore[arg-type]


def test_defaults_are_the_last_30_days_by_day_and_the_last_day_by_hour() -> None:
    q = parse_query({}, NOW)
    assert (q.group_by, q.end, q.start, q.bucket_s) == ("day", NOW, NOW - timedelta(days=30), 86400)
    q = parse_query({"group_by": "hour", "format": "csv"}, NOW)
    assert (q.start, q.format, q.bucket_s) == (NOW - timedelta(days=1), "csv", 3600)


def test_times_without_a_zone_are_utc_and_z_is_accepted() -> None:
    q = parse_query({"start": "2026-11-01", "end": "2026-11-02T06:00:00Z"}, NOW)
    assert q.start == datetime(2026, 11, 1, tzinfo=UTC)
    assert q.end == datetime(2026, 11, 2, 6, tzinfo=UTC)
    q = parse_query({"start": "2026-11-01T01:00:00+01:00", "end": "2026-11-02"}, NOW)
    assert q.start == datetime(2026, 11, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"group_by": "minute"}, "group_by"),
        ({"format": "xlsx"}, "format"),
        ({"start": "last week"}, "start"),
        ({"end": "2026-13-01"}, "end"),
        ({"start": "2026-11-02", "end": "2026-11-01"}, "start"),
        ({"start": "1990-01-01", "group_by": "hour"}, "start"),
    ],
)
def test_bad_parameters_are_named(params: dict[str, str], param: str) -> None:
    with pytest.raises(BadQuery) as info:
        parse_query(params, NOW)
    assert info.value.param == param and param.split("_")[0] in str(info.value)


def test_csv_has_every_column_and_empty_cells_for_missing_values() -> None:
    text = to_csv([period(), period(tenant_name=None, slo_attainment=None, slo_judged=0)])
    rows = list(csv.reader(io.StringIO(text)))
    assert tuple(rows[0]) == COLUMNS
    first = dict(zip(COLUMNS, rows[1], strict=True))
    assert first["period_start"] == "2026-11-20T00:00:00Z" and first["ttft_ms_p50"] == "120.5"
    assert first["tpot_ms_p99"] == "" and first["slo_attainment"] == "0.75"
    assert dict(zip(COLUMNS, rows[2], strict=True))["tenant_name"] == ""


def test_table_is_aligned_and_says_when_empty() -> None:
    lines = to_table(
        [period(), period(tenant_name="a-much-longer-name", requests=12345)]
    ).splitlines()
    assert len({len(line) for line in lines}) == 1  # every line as wide as the header
    assert lines[1].split()[-5] == "75.0%" and " - " in lines[1]
    assert lines[0].split()[-4:] == ["shed", "downgr", "adm_met", "adm_miss"]
    admission = to_table([period(shed=3, downgraded=2, admitted_met=4, admitted_missed=1)])
    assert admission.splitlines()[1].split()[-4:] == ["3", "2", "4", "1"]
    assert "(no requests in this range)" in to_table([])
