"""Usage reports: per tenant and period, computed by one SQL query on SQLite or PostgreSQL.

Each row covers one tenant in one period (a UTC day, hour or smaller bucket aligned on the Unix
epoch; periods without requests are left out): requests, prompt and completion tokens, errors
(every status but ok; the 429s of quotas are also counted apart as `rate_limited`), TTFT and TPOT
p50/p99 and SLO attainment (met / judged; requests whose contract sets no target are not judged).

Percentiles are nearest-rank on both databases (see gateway.report_sql, which holds the queries;
this module parses report requests and formats the rows as JSON, CSV or a text table).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

# The queries' names are re-exported: the admin API, the CLI, the dashboard and tests import them
# from here.
from gateway.report_sql import UsagePeriod as UsagePeriod
from gateway.report_sql import tier_series as tier_series
from gateway.report_sql import usage_report as usage_report

GROUP_BY_S = {"day": 86_400, "hour": 3_600}
"""The public report's period lengths, seconds."""
DEFAULT_SPAN_S = {"day": 30 * 86_400, "hour": 86_400}
"""Span of a report whose `start` is not given: 30 days by day, 24 hours by hour."""
MAX_PERIODS = 20_000
"""Most periods one report may span (a larger range is refused: ask for days instead)."""
COLUMNS = (
    "period_start",
    "tenant_id",
    "tenant_name",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "errors",
    "rate_limited",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "slo_met",
    "slo_judged",
    "slo_attainment",
)
"""Field order of the JSON rows, the CSV and the CLI table."""


class ReportQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A validated report request."""

    start: datetime
    end: datetime
    group_by: str
    bucket_s: int
    tenant: str | None = None
    format: str = "json"


class BadQuery(ValueError):
    """An invalid report parameter; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_query(
    params: Mapping[str, str], now: datetime, formats: tuple[str, ...] = ("json", "csv")
) -> ReportQuery:
    """The report asked for by *params* (tenant, start, end, group_by, format)."""
    group_by = params.get("group_by") or "day"
    if group_by not in GROUP_BY_S:
        raise BadQuery("group_by", f"group_by must be 'day' or 'hour', got {group_by!r}")
    fmt = params.get("format") or formats[0]
    if fmt not in formats:
        raise BadQuery("format", f"format must be one of {', '.join(formats)}, got {fmt!r}")
    end = parse_time("end", params["end"]) if params.get("end") else now
    start = (
        parse_time("start", params["start"])
        if params.get("start")
        else end - timedelta(seconds=DEFAULT_SPAN_S[group_by])
    )
    if start >= end:
        raise BadQuery(
            "start", f"start ({start.isoformat()}) must be before end ({end.isoformat()})"
        )
    bucket_s = GROUP_BY_S[group_by]
    if (end - start).total_seconds() / bucket_s > MAX_PERIODS:
        raise BadQuery(
            "start",
            f"the range from start to end spans more than {MAX_PERIODS} "
            f"periods of one {group_by}; narrow it or group by day",
        )
    return ReportQuery(
        start=start,
        end=end,
        group_by=group_by,
        bucket_s=bucket_s,
        tenant=params.get("tenant") or None,
        format=fmt,
    )


def parse_time(param: str, text: str) -> datetime:
    """An ISO 8601 date or date-time; without a zone it is UTC."""
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise BadQuery(
            param,
            f"{param} must be an ISO 8601 date or date-time (e.g. "
            f"2026-11-21 or 2026-11-21T06:00:00Z), got {text!r}",
        ) from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def to_csv(rows: list[UsagePeriod]) -> str:
    """The rows as CSV with a header line (empty cells for missing values)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(["" if v is None else v for v in _cells(row)])
    return out.getvalue()


def to_table(rows: list[UsagePeriod]) -> str:
    """The rows as an aligned text table for a terminal."""
    header = (
        "period",
        "tenant",
        "requests",
        "prompt_tok",
        "compl_tok",
        "errors",
        "429s",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "tpot_p99",
        "slo",
    )
    lines = [header]
    for r in rows:
        lines.append(
            (
                r.period_start.strftime("%Y-%m-%d %H:%M"),
                r.tenant_name or r.tenant_id,
                str(r.requests),
                str(r.prompt_tokens),
                str(r.completion_tokens),
                str(r.errors),
                str(r.rate_limited),
                _ms(r.ttft_ms_p50),
                _ms(r.ttft_ms_p99),
                _ms(r.tpot_ms_p50),
                _ms(r.tpot_ms_p99),
                "-" if r.slo_attainment is None else f"{100 * r.slo_attainment:.1f}%",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]
    if not rows:
        text.append("(no requests in this range)")
    return "\n".join(text)


def _cells(row: UsagePeriod) -> list[Any]:
    values = msgspec.structs.asdict(row)
    values["period_start"] = row.period_start.isoformat().replace("+00:00", "Z")
    return [values[c] for c in COLUMNS]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
