"""Usage reports: per tenant and period, computed by one SQL query on SQLite or PostgreSQL.

Each row covers one tenant in one period (a UTC day, hour or smaller bucket aligned on the Unix
epoch; periods without requests are left out), counting the requests that finished in it — when
their work ran, so a batch whose lines waited on the engine for minutes shows as the minutes its
lines finished in, not as a spike when it was submitted: requests, prompt and completion
tokens, errors (every status but ok and a cancel; the 429s of quotas are also counted apart as
`rate_limited`), cancels (the client stopped the request or its batch: status
`client_disconnected`; billed for what ran, never judged against the SLO), TTFT and TPOT p50/p99
and SLO attainment (met / judged; requests whose contract sets no target are not judged), and
what the SLO admission did with the RT requests: shed (refused: `slo_unattainable`), downgraded
(run as BE), and of those it let run as RT, how many met the SLO and how many missed.

Batch work a gateway shutdown cut off (status `interrupted`) is left out of every figure: its
line runs again after the restart, and that run is the one counted and billed. The record stays
in the request log (`GET /admin/v1/requests`), as what the engine did.

Percentiles are *nearest-rank* (the smallest value with at least p % of the values at or below
it: rank ceil(p·n)): PostgreSQL's percentile_disc, and on SQLite (which has no percentile
function) the same rank picked with window functions, so both give identical answers.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import msgspec
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Table,
    and_,
    case,
    func,
    literal_column,
    select,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.store.models import TenantRow, UsageRow

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
    "cancelled",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "slo_met",
    "slo_judged",
    "slo_attainment",
    "shed",
    "downgraded",
    "admitted_met",
    "admitted_missed",
)
"""Field order of the JSON rows, the CSV and the CLI table."""

CANCELLED = "client_disconnected"
"""The status of a request its client stopped (gateway/pipeline/outcome.py)."""
INTERRUPTED = "interrupted"
"""The status of batch work a gateway shutdown cut off: left out of every report."""

_usage = cast(Table, UsageRow.__table__)
_tenants = cast(Table, TenantRow.__table__)


class UsagePeriod(msgspec.Struct, kw_only=True):
    """One tenant's usage in one period."""

    period_start: datetime
    """Start of the period, UTC."""
    tenant_id: str
    tenant_name: str | None
    """The tenant's name (None if the tenant row is gone)."""
    requests: int
    """Requests that finished in the period (`finished_at`: answered, refused or failed)."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    errors: int
    """Requests that did not end ok (any reason, rate limits included), cancels excepted."""
    rate_limited: int
    """Requests refused by the tenant's quota (429)."""
    cancelled: int = 0
    """Requests the client stopped (a stream it closed, a batch it cancelled): not errors, and
    not judged against the SLO."""
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    slo_met: int
    """Requests that met their SLO."""
    slo_judged: int
    """Requests with an SLO to meet."""
    slo_attainment: float | None
    """slo_met / slo_judged (None when nothing was judged)."""
    shed: int = 0
    """RT requests the SLO admission refused (429 `slo_unattainable`; also in `errors`)."""
    downgraded: int = 0
    """RT requests the SLO admission ran as BE (forecast to miss the RT contract)."""
    admitted_met: int = 0
    """RT requests the SLO admission let run as RT that met the SLO."""
    admitted_missed: int = 0
    """RT requests the SLO admission let run as RT that missed it (failures included); those
    it accepted though forecast to miss count here too when they did."""


class ReportQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A validated report request."""

    start: datetime
    end: datetime
    group_by: str
    bucket_s: int
    tenant: str | None = None
    engine: str | None = None
    """Only the requests this engine ran (its name in /readyz); None: all."""
    format: str = "json"


class BadQuery(ValueError):
    """An invalid report parameter; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_query(
    params: Mapping[str, str], now: datetime, formats: tuple[str, ...] = ("json", "csv")
) -> ReportQuery:
    """The report asked for by *params* (tenant, engine, start, end, group_by, format)."""
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
        engine=params.get("engine") or None,
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


async def usage_report(
    db: AsyncEngine,
    start: datetime,
    end: datetime,
    bucket_s: int,
    tenant_id: str | None = None,
    engine: str | None = None,
) -> list[UsagePeriod]:
    """Usage per tenant and period of *bucket_s* seconds for requests finished in [start, end),
    oldest period first, then by tenant id; with *engine*, only the requests that engine ran
    (one replica's figures, to compare with another's)."""
    async with db.connect() as conn:
        stmt = _report_sql(conn.dialect.name, start, end, bucket_s, tenant_id, engine)
        rows = (await conn.execute(stmt)).mappings().all()
    return [_period(row) for row in rows]


class EngineTotals(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's requests finished in a window, counted as the usage report counts them
    (the dashboard's Engines table: one replica's record beside another's)."""

    requests: int
    """Requests it ran (batch work a shutdown cut off left out)."""
    errors: int
    """Those that failed (a cancel is no error)."""
    slo_attainment: float | None
    """Share of its judged requests that met their tenant's SLO; None: none judged."""


def _counts(source: Any) -> list[ColumnElement[Any]]:
    """The counts a usage figure and an engine's totals share, over *source*'s usage columns:
    errors (a cancel is none), SLO met, SLO judged."""
    return [
        func.sum(case((source.c.status.not_in(("ok", CANCELLED)), 1), else_=0)).label("errors"),
        func.sum(case((source.c.slo_met.is_(True), 1), else_=0)).label("slo_met"),
        func.sum(case((source.c.slo_met.is_not(None), 1), else_=0)).label("slo_judged"),
    ]


async def engine_totals(db: AsyncEngine, start: datetime, end: datetime) -> dict[str, EngineTotals]:
    """Per engine (its name in /readyz), the requests it ran that finished in [start, end)."""
    u = _usage
    stmt = (
        select(
            u.c.engine,
            func.count().label("requests"),
            *_counts(u),
        )
        .where(
            u.c.finished_at >= start,
            u.c.finished_at < end,
            u.c.status != INTERRUPTED,
            u.c.engine.is_not(None),
        )
        .group_by(u.c.engine)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(stmt)).mappings().all()
    return {
        row["engine"]: EngineTotals(
            requests=int(row["requests"]),
            errors=int(row["errors"] or 0),
            slo_attainment=int(row["slo_met"]) / int(row["slo_judged"])
            if row["slo_judged"]
            else None,
        )
        for row in rows
    }


def _bucket(dialect: str, bucket_s: int) -> ColumnElement[Any]:
    """Start of the period a request finished in, as Unix seconds (an integer) in the
    dialect's SQL."""
    column = _usage.c.finished_at
    # the size is inlined, not bound: PostgreSQL matches GROUP BY expressions textually, and
    # two bind parameters of the same value would not match
    size = literal_column(str(int(bucket_s)), Integer)
    if dialect == "postgresql":
        epoch = func.floor(func.extract("epoch", column) / size) * size
        return sql_cast(epoch, BigInteger)
    # SQLite stores the UTC time as text; strftime('%s') reads it as Unix seconds
    seconds = sql_cast(func.strftime("%s", column), Integer)
    return (seconds // size) * size


def _report_sql(
    dialect: str,
    start: datetime,
    end: datetime,
    bucket_s: int,
    tenant_id: str | None,
    engine: str | None = None,
) -> Any:
    u = _usage
    where = [u.c.finished_at >= start, u.c.finished_at < end, u.c.status != INTERRUPTED]
    if tenant_id is not None:
        where.append(u.c.tenant_id == tenant_id)
    if engine is not None:
        where.append(u.c.engine == engine)
    base = (
        select(
            u.c.tenant_id,
            _bucket(dialect, bucket_s).label("bucket"),
            u.c.ttft_ms,
            u.c.tpot_ms,
            u.c.prompt_tokens,
            u.c.completion_tokens,
            u.c.status,
            u.c.slo_met,
            u.c.admission,
        )
        .where(*where)
        .cte("base")
    )
    keys = (base.c.tenant_id, base.c.bucket)
    ran_as_rt = base.c.admission.in_(("admitted", "unchecked", "accepted"))
    # PostgreSQL's percentile_disc is the nearest-rank percentile: one pass, no window sort
    native = (
        [
            func.percentile_disc(p / 100).within_group(base.c[column]).label(f"{column}_p{p}")
            for column in ("ttft_ms", "tpot_ms")
            for p in (50, 99)
        ]
        if dialect == "postgresql"
        else []
    )
    agg = (
        select(
            *keys,
            *native,
            func.count().label("requests"),
            func.sum(base.c.prompt_tokens).label("prompt_tokens"),
            func.sum(base.c.completion_tokens).label("completion_tokens"),
            *_counts(base),
            func.sum(case((base.c.status == "rate_limited", 1), else_=0)).label("rate_limited"),
            func.sum(case((base.c.status == CANCELLED, 1), else_=0)).label("cancelled"),
            func.sum(case((base.c.admission == "shed", 1), else_=0)).label("shed"),
            func.sum(case((base.c.admission == "downgraded", 1), else_=0)).label("downgraded"),
            func.sum(case((and_(ran_as_rt, base.c.slo_met.is_(True)), 1), else_=0)).label(
                "admitted_met"
            ),
            func.sum(case((and_(ran_as_rt, base.c.slo_met.is_(False)), 1), else_=0)).label(
                "admitted_missed"
            ),
        )
        .group_by(*keys)
        .cte("agg")
    )
    if native:
        return (
            select(agg, _tenants.c.name.label("tenant_name"))
            .select_from(agg.outerjoin(_tenants, _tenants.c.id == agg.c.tenant_id))
            .order_by(agg.c.bucket, agg.c.tenant_id)
        )
    ttft = _percentiles(base, "ttft_ms")
    tpot = _percentiles(base, "tpot_ms")

    def joined(part: Any) -> ColumnElement[bool]:
        return and_(part.c.tenant_id == agg.c.tenant_id, part.c.bucket == agg.c.bucket)

    return (
        select(
            agg,
            ttft.c.ttft_ms_p50,
            ttft.c.ttft_ms_p99,
            tpot.c.tpot_ms_p50,
            tpot.c.tpot_ms_p99,
            _tenants.c.name.label("tenant_name"),
        )
        .select_from(
            agg.outerjoin(ttft, joined(ttft))
            .outerjoin(tpot, joined(tpot))
            .outerjoin(_tenants, _tenants.c.id == agg.c.tenant_id)
        )
        .order_by(agg.c.bucket, agg.c.tenant_id)
    )


def _percentiles(base: Any, column: str) -> Any:
    """p50 and p99 (nearest rank) of *column* per tenant and period, NULLs left out."""
    value = base.c[column]
    keys = (base.c.tenant_id, base.c.bucket)
    ranked = (
        select(
            *keys,
            value.label("v"),
            func.row_number().over(partition_by=keys, order_by=value).label("rn"),
            func.count().over(partition_by=keys).label("n"),
        )
        .where(value.is_not(None))
        .cte(f"{column}_ranked")
    )
    # rank ceil(p·n) in integer arithmetic: (n·p% + 99) // 100
    return (
        select(
            ranked.c.tenant_id,
            ranked.c.bucket,
            func.min(case((ranked.c.rn == (ranked.c.n * 50 + 99) // 100, ranked.c.v))).label(
                f"{column}_p50"
            ),
            func.min(case((ranked.c.rn == (ranked.c.n * 99 + 99) // 100, ranked.c.v))).label(
                f"{column}_p99"
            ),
        )
        .group_by(ranked.c.tenant_id, ranked.c.bucket)
        .cte(f"{column}_pct")
    )


def _period(row: Any) -> UsagePeriod:
    prompt, completion = int(row["prompt_tokens"] or 0), int(row["completion_tokens"] or 0)
    met, judged = int(row["slo_met"] or 0), int(row["slo_judged"] or 0)
    return UsagePeriod(
        period_start=datetime.fromtimestamp(int(row["bucket"]), UTC),
        tenant_id=row["tenant_id"],
        tenant_name=row["tenant_name"],
        requests=int(row["requests"]),
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        errors=int(row["errors"] or 0),
        rate_limited=int(row["rate_limited"] or 0),
        cancelled=int(row["cancelled"] or 0),
        ttft_ms_p50=_opt(row["ttft_ms_p50"]),
        ttft_ms_p99=_opt(row["ttft_ms_p99"]),
        tpot_ms_p50=_opt(row["tpot_ms_p50"]),
        tpot_ms_p99=_opt(row["tpot_ms_p99"]),
        slo_met=met,
        slo_judged=judged,
        slo_attainment=met / judged if judged else None,
        shed=int(row["shed"] or 0),
        downgraded=int(row["downgraded"] or 0),
        admitted_met=int(row["admitted_met"] or 0),
        admitted_missed=int(row["admitted_missed"] or 0),
    )


def _opt(value: Any) -> float | None:
    return None if value is None else float(value)


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
        "cancel",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "tpot_p99",
        "slo",
        "shed",
        "downgr",
        "adm_met",
        "adm_miss",
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
                str(r.cancelled),
                _ms(r.ttft_ms_p50),
                _ms(r.ttft_ms_p99),
                _ms(r.tpot_ms_p50),
                _ms(r.tpot_ms_p99),
                "-" if r.slo_attainment is None else f"{100 * r.slo_attainment:.1f}%",
                str(r.shed),
                str(r.downgraded),
                str(r.admitted_met),
                str(r.admitted_missed),
            )
        )
    text = _aligned(lines, left=2)
    if not rows:
        text.append("(no requests in this range)")
    return "\n".join(text)


def requests_table(records: list[dict[str, Any]], tenant_names: dict[str, str]) -> str:
    """Usage records as `GET /admin/v1/requests` gives them, as an aligned text table for a
    terminal, one row each (times in ms)."""
    header = ("started", "tenant", "tier", "status", "http", "prompt", "compl", "ttft_ms",
              "tpot_ms", "e2e_ms", "slo", "admission", "engine")  # fmt: skip
    lines = [header]
    for r in records:
        lines.append(
            (
                r["created_at"][:19].replace("T", " "),
                tenant_names.get(r["tenant_id"], r["tenant_id"]),
                r["tier"],
                r["status"],
                str(r["http_status"]),
                str(r["prompt_tokens"]),
                str(r["completion_tokens"]),
                *(_ms(r[k]) for k in ("ttft_ms", "tpot_ms", "e2e_ms")),
                {True: "met", False: "missed"}.get(r["slo_met"], "-"),
                r["admission"] or "-",
                r["engine"] or "-",
            )
        )
    text = [line.rstrip() for line in _aligned(lines, left=len(header))]
    if not records:
        text.append("(no requests)")
    return "\n".join(text)


def _aligned(lines: Sequence[Sequence[str]], left: int) -> list[str]:
    """*lines* (a header first) in columns two spaces apart: the first *left* columns
    left-aligned, the rest right-aligned."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]


def _cells(row: UsagePeriod) -> list[Any]:
    values = msgspec.structs.asdict(row)
    values["period_start"] = row.period_start.isoformat().replace("+00:00", "Z")
    return [values[c] for c in COLUMNS]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


async def tier_series(
    db: AsyncEngine, start: datetime, end: datetime, bucket_s: int
) -> list[dict[str, Any]]:
    """Requests and tokens per tier and period (for "BE throughput against RT load"):
    ``{"t": period start (Unix s), "tier", "requests", "prompt_tokens", "completion_tokens"}``,
    oldest first; failed requests count with the tokens they did produce."""
    u = _usage
    async with db.connect() as conn:
        bucket = _bucket(conn.dialect.name, bucket_s).label("bucket")
        stmt = (
            select(
                bucket,
                u.c.tier,
                func.count().label("requests"),
                func.sum(u.c.prompt_tokens).label("prompt_tokens"),
                func.sum(u.c.completion_tokens).label("completion_tokens"),
            )
            .where(u.c.finished_at >= start, u.c.finished_at < end, u.c.status != INTERRUPTED)
            .group_by(bucket, u.c.tier)
            .order_by(bucket, u.c.tier)
        )
        rows = (await conn.execute(stmt)).all()
    return [
        {
            "t": int(b),
            "tier": tier,
            "requests": int(n),
            "prompt_tokens": int(p or 0),
            "completion_tokens": int(c or 0),
        }
        for b, tier, n, p, c in rows
    ]
