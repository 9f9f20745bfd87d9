"""Writes a bench run: results.json (the schema of API.md, plus extras), report.md (one table,
one row per policy, with the command line and parameters) and the PNG plots.

results.json is a function of the command's parameters and seed, except the `run_info` section
(capacity provenance, wall-clock run times) and the policies' wall-clock planning metrics
(bench.metrics.WALL_CLOCK_KEYS: plan_ms_p50, plan_ms_p99, plan_ms_mean, plan_overhead_frac).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.capacity import TARGET_ATTAINMENT
from bench.metrics import WALL_CLOCK_KEYS, rounded
from bench.plots import write_plots
from bench.runner import BenchConfig, BenchRun, PolicyRun
from common.slowdown import format_slowdown

# (metric key, column header, format): "pct" percent, "s" seconds, "r" rate, "x" ratio
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rt_ttft_attainment", "RT TTFT att.", "pct"),
    ("rt_tpot_attainment", "RT TPOT att.", "pct"),
    ("rt_joint_attainment", "RT joint att.", "pct"),
    ("rt_token_attainment", "RT token att.", "pct"),
    ("rt_iteration_attainment", "RT iter. att.", "pct"),
    ("rt_ttft_p50_s", "TTFT p50 s", "s"),
    ("rt_ttft_p99_s", "TTFT p99 s", "s"),
    ("rt_tbt_p99_s", "TBT p99 s", "s"),
    ("rt_normalized_latency_s", "norm. latency s/tok", "s"),
    ("rt_interference_tbt_p99", "TBT p99 ÷ rt-only", "x"),
    ("be_throughput_tok_s", "BE tok/s", "r"),
    ("be_throughput_req_s", "BE req/s", "r"),
    ("be_total_tok_s", "BE total tok/s", "r"),
    ("be_max_wait_s", "BE max wait s", "s"),
    ("be_jct_attainment", "BE JCT att.", "pct"),
    ("goodput_req_s", "goodput req/s", "r"),
    ("eviction_rate", "evicted", "pct"),
    ("kv_utilization_mean", "KV use", "pct"),
    ("prefix_reuse_ratio", "prefix reuse", "pct"),
    ("plan_ms_p50", "plan ms p50", "s"),
    ("placement_us_p50", "place µs p50", "s"),
)


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "pct":
        return f"{100 * value:.1f} %"
    if kind == "x":
        return f"{value:.2f}"
    if kind == "r":
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return f"{value:.3g}"


def _row(r: PolicyRun) -> dict[str, Any]:
    """One policy's results.json row: its metrics, plus `tenants` when the workload has any."""
    row = rounded(r.metrics)
    if r.tenants is not None:
        row["tenants"] = {name: rounded(m) for name, m in r.tenants.items()}
    return row


def results_dict(run: BenchRun) -> dict[str, Any]:
    """results.json: API.md's keys first, then the run's parameters, then `run_info`."""
    cfg = run.config
    out: dict[str, Any] = {
        "workload": run.workload.name,
        "engine": cfg.engine,
        "profile": run.profile.name,
        "seed": cfg.seed,
        "load": cfg.load,
        "rt_capacity_req_s": run.rt_capacity_req_s,
        "rt_rate_req_s": run.rt_rate_req_s,
        "policies": {} if run.by_router else {name: _row(r) for name, r in run.runs.items()},
        "description": run.workload.description,
        "variant": cfg.variant,
        "max_new": cfg.max_new,
        "kv_capacity_tokens": run.kv_capacity_tokens,
        "kv_scale": cfg.kv_scale,
        "window_s": run.workload.window_s,
        "workload_params": run.workload.params,
        "capacity_criterion": (
            f"RT alone, Poisson, fcfs: joint TTFT+TPOT attainment ≥ "
            f"{TARGET_ATTAINMENT:.0%} over {cfg.capacity_run_s:g} s runs"
        ),
        "skipped_policies": run.skipped,
        "failed_policies": run.failed,
        "run_info": {
            "note": "differs between identical runs: wall-clock values and cache provenance; "
            f"so do the policies' {', '.join(sorted(WALL_CLOCK_KEYS))}",
            "capacity_source": run.capacity_source,
            "policy_wall_s": {name: round(r.wall_s, 3) for name, r in run.runs.items()},
        },
    }
    if run.by_router:  # only for a pool: a one-engine run is unchanged
        out["routers"] = {name: _row(r) for name, r in run.runs.items()}
        out["replicas"] = cfg.replicas
        out["engine_policy"] = run.engine_policy
    if cfg.replica_slowdowns:  # only when set
        out["replica_slowdowns"] = list(cfg.replica_slowdowns)
    if cfg.engine_noise:  # only when set
        out["engine_noise"] = cfg.engine_noise
    if cfg.on_unattainable:  # only when set; "*": every tenant not named
        out["on_unattainable"] = {t or "*": o for t, o in cfg.on_unattainable}
    out.update(slowdown_fields(cfg))
    return out


def slowdown_fields(cfg: BenchConfig) -> dict[str, Any]:
    """`engine_slowdown` (the flag's text) and `engine_slowdown_schedule` for results.json, the
    simulator's and the live bench's; {} without a slowdown (a run without it is unchanged)."""
    if not cfg.engine_slowdown:
        return {}
    return {
        "engine_slowdown": format_slowdown(cfg.engine_slowdown),
        "engine_slowdown_schedule": [
            {"start_s": start_s, "factor": factor} for start_s, factor in cfg.engine_slowdown
        ],
    }


def _table(run: BenchRun) -> list[str]:
    metrics = {name: r.metrics for name, r in run.runs.items()}
    cols = [c for c in COLUMNS if any(m.get(c[0]) is not None for m in metrics.values())]
    lines = [
        f"| {'router' if run.by_router else 'policy'} | "
        + " | ".join(header for _, header, _ in cols)
        + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name, m in metrics.items():
        cells = [_fmt(m.get(key), kind) for key, _, kind in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def tenant_table(by_policy: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The per-tenant table of a report: one row per (policy, tenant) of *by_policy* (policy →
    tenant → `bench.metrics.tenant_metrics` row); empty when it has none."""
    rows = [(name, tenants) for name, tenants in by_policy.items() if tenants]
    if not rows:
        return []
    lines = [
        "Per tenant (token share: of the tokens served to the tier while every tenant of the "
        "tier had work outstanding; queued share: while every tenant of the tier had a request "
        "waiting for admission; fair share = weight ÷ the tier's weights):",
        "",
        "| policy | tenant | tier | weight | requests | RT adm. att. | token share | contended s "
        "| queued share | queued s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, tenants in rows:
        for tenant, m in tenants.items():
            cells = [
                name,
                tenant,
                str(m["tier"]),
                f"{m['weight']:g}",
                str(m["requests"]),
                _fmt(m.get("rt_admitted_attainment"), "pct"),
                _fmt(m.get("token_share"), "pct"),
                _fmt(m.get("contended_s"), "s"),
                _fmt(m.get("token_share_queued"), "pct"),
                _fmt(m.get("queued_s"), "s"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _parameters(run: BenchRun) -> list[str]:
    cfg = run.config
    rate = "–" if run.rt_rate_req_s is None else f"{run.rt_rate_req_s:.3f} req/s"
    capacity = (
        "–"
        if run.rt_capacity_req_s is None
        else f"{run.rt_capacity_req_s:.3f} req/s ({run.capacity_source})"
    )
    window = (
        f"{run.workload.window_s:g} s"
        if run.workload.window_s is not None
        else "the whole run (offline / closed loop)"
    )
    params = ", ".join(f"{k}={v}" for k, v in run.workload.params.items())
    lines = [
        f"* workload: **{run.workload.name}** — {run.workload.description}",
        f"* workload parameters: {params}",
        f"* engine: {cfg.engine}; profile: {run.profile.name}; KV pool: "
        f"{run.kv_capacity_tokens} tokens"
        + (f" (--kv-scale {cfg.kv_scale:g} × longest prompt)" if cfg.kv_scale else ""),
        f"* seed: {cfg.seed}; load: {cfg.load:g}; λ*: {capacity}; RT rate: {rate}",
        f"* measurement window: {window}; max_new_tokens shown to policies: {cfg.max_new}",
    ]
    if run.by_router:
        lines.append(
            f"* pool: {cfg.replicas} replicas, each running `{run.engine_policy}`; rows are "
            "placement policies (backend/policy/placement.py); λ* and the RT rate are the "
            "pool's (N × one replica's)"
        )
    if cfg.replica_slowdowns:
        slowed = ", ".join(
            f"replica {i} × {k:g}" for i, k in enumerate(cfg.replica_slowdowns) if k != 1
        )
        lines.append(
            f"* unequal replicas: {slowed} (their iterations take that many times the latency "
            "model's prediction; the policies and the router are not told)"
        )
    if cfg.engine_slowdown:
        lines.append(
            f"* engine slowdown: {format_slowdown(cfg.engine_slowdown)} (iterations take K × "
            "the latency model's prediction, K from simulated second T for K@T; the policies "
            "are not told)"
        )
    if cfg.engine_noise:
        lines.append(
            f"* engine noise: σ {cfg.engine_noise:g} (each iteration takes a further log-normal "
            "factor of mean 1 of its time, drawn per iteration from the run's seed; the "
            "policies are not told)"
        )
    if cfg.on_unattainable:
        named = ", ".join(f"{t or 'every other tenant'}: {o}" for t, o in cfg.on_unattainable)
        lines.append(
            f"* an RT request forecast to miss its contract — {named} (reject: shed; "
            "downgrade: run as BE; accept: run as RT anyway)"
        )
    lines += [f"* skipped `{name}`: {why}" for name, why in run.skipped.items()]
    lines += [f"* **failed** `{name}`: {why}" for name, why in run.failed.items()]
    return lines


def report_markdown(run: BenchRun, plots: list[str]) -> str:
    """report.md."""
    wall = ", ".join(f"{name} {r.wall_s:.1f} s" for name, r in run.runs.items())
    lines = [
        f"# {run.workload.name} on {run.config.engine}",
        "",
        f"Command: `{run.config.command}`",
        "",
        *_parameters(run),
        "",
        *_table(run),
        "",
        *tenant_table({name: r.tenants for name, r in run.runs.items() if r.tenants}),
        "Attainments are shares of RT requests (token att.: of RT tokens; iter. att.: of "
        "iterations emitting RT tokens, all of them on time); rates are per "
        "second of the measurement window; `–` = not applicable. Every metric, with its "
        "definition and unit, is in results.json and explained in bench/README.md.",
        "",
        f"Wall-clock time per policy: {wall}.",
        "",
    ]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def write_outputs(run: BenchRun, out_dir: Path) -> list[Path]:
    """Writes results.json, report.md and the PNGs into out_dir; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots({n: r.series for n, r in run.runs.items()}, out_dir, run.workload.name)
    results = out_dir / "results.json"
    results.write_text(json.dumps(results_dict(run), indent=1) + "\n")
    report = out_dir / "report.md"
    report.write_text(report_markdown(run, plots))
    return [results, report, *(out_dir / p for p in plots)]
