"""results.json, report.md and plots of a live run (`tandem bench … --engine sglang`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.policy.calibration import REGIMES
from bench.calibration_recovery import ERROR_BAND, ERROR_WINDOW_S
from bench.live import RATIO_KEYS, SERVING_PROBES, LiveRun, sim_real_ratios
from bench.metrics import rounded
from bench.plots import write_plots
from bench.policy_spec import base_name
from bench.report import _fmt, slowdown_fields, tenant_table
from common.slowdown import format_slowdown

LIVE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("rt_ttft_attainment", "RT TTFT att.", "pct"),
    ("rt_tpot_attainment", "RT TPOT att.", "pct"),
    ("rt_admitted_attainment", "RT adm. att.", "pct"),
    ("rt_shed_rate", "RT shed", "pct"),
    ("rt_ttft_p50_s", "TTFT p50 s", "s"),
    ("rt_ttft_p99_s", "TTFT p99 s", "s"),
    ("rt_admitted_ttft_p99_s", "adm. TTFT p99 s", "s"),
    ("rt_tpot_mean_s", "TPOT mean s", "s"),
    ("rt_tbt_p99_s", "TBT p99 s", "s"),
    ("be_throughput_tok_s", "BE tok/s", "r"),
    ("be_finished", "BE done", "r"),
    ("rt_finished", "RT done", "r"),
    ("goodput_req_s", "goodput req/s", "r"),
)
STAT_KEYS = (
    "iterations",
    "mean_iteration_ms",
    "overhead_frac",
    "rt_time_frac",
    "plan_ms_p50",
    "plan_ms_p99",
    "parked_decodes",
    "evictions",
    "retractions_ordered",
    "admitted_prefills",
    "refused_prefills",
    "parked_chunks",
    "released_chunks",
    "peak_running",
    "peak_kv_used_tokens",
)


def rechecks_line(name: str, stats: dict[str, Any]) -> str:
    """One line: the RT requests the gateway judged again as request slots freed."""
    counts = stats.get("gateway_slo_rechecks")
    if not isinstance(counts, dict):
        return f"* {name}: the gateway's rechecks were not read ({counts or 'not recorded'})"
    total = sum(counts.values())
    verdicts = ", ".join(f"{outcome} {n:.0f}" for outcome, n in sorted(counts.items()))
    return f"* {name}: the gateway judged {total:.0f} RT requests again as request slots freed" + (
        f" ({verdicts})" if verdicts else ""
    )


def results_dict(run: LiveRun) -> dict[str, Any]:
    """API.md's results.json (real-engine metrics under "policies"), plus the simulator twin's
    metrics, the sim/real ratios and tandem's in-engine counters."""
    cfg = run.config
    return {
        "workload": cfg.workload,
        "engine": "sglang",
        "profile": run.profile_name,
        "seed": cfg.seed,
        "load": cfg.load if cfg.rt_rate_req_s is None else None,
        "variant": cfg.variant,
        **slowdown_fields(cfg),
        "rt_capacity_req_s": run.rt_capacity_req_s,
        "rt_rate_req_s": run.rt_rate_req_s,
        "kv_capacity_tokens": run.kv_capacity_tokens,
        "sim_rt_capacity_req_s": run.sim_capacity_req_s,
        "capacity_probes": [list(p) for p in run.capacity_probes],
        "policy_options": run.policy_options,
        "row_options": {name: run.options_of(name) for name in run.real if base_name(name) != name},
        "sim_pace": run.sim_pace,
        "serving_overhead_ms": {k: round(v * 1000, 2) for k, v in run.serving_overhead_s.items()},
        "sim_regime_pace": dict(zip(REGIMES, run.sim_regime_pace, strict=True))
        if run.sim_regime_pace
        else None,
        "sim_engine": {
            "iterations": run.sim_engine_iterations,
            "weights": run.sim_engine.pieces,
            "error": run.sim_engine_error,
        }
        if run.sim_engine is not None
        else None,
        "command": cfg.command,
        "policies": {name: _row(m, run.tenants.get(name)) for name, m in run.real.items()},
        "sim": {name: _row(m, run.sim_tenants.get(name)) for name, m in run.sim.items()},
        "sim_over_real": sim_real_ratios(run),
        "engine_stats": run.engine_stats,
        **({"calibration_recovery": run.calibration_recovery} if run.calibration_recovery else {}),
        "failed": run.failed,
        "wall_s": {k: round(v, 1) for k, v in run.wall_s.items()},
    }


def _recovery_lines(run: LiveRun) -> list[str]:
    """One line per policy and change of the slowdown: how fast its calibration followed."""

    def seconds(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f} s"

    return [
        f"* {name}: at second {c['at_s']:g} the engine went from {c['from_factor']:g}× to "
        f"{c['factor']:g}×; the calibrated model's error was back within {ERROR_BAND:.0%} "
        f"after {seconds(c['error_back_within_band_s'])} (median per iteration over "
        f"{ERROR_WINDOW_S:g} s windows; p50 of predicted ÷ measured: "
        f"{seconds(c['ratio_p50_back_within_band_s'])})"
        for name, changes in run.calibration_recovery.items()
        for c in changes
    ]


def _row(metrics: Any, tenants: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """One policy's row: its metrics, plus `tenants` when the workload names tenants."""
    row = dict(rounded(metrics))
    if tenants:
        row["tenants"] = {name: rounded(m) for name, m in tenants.items()}
    return row


def _table(rows: dict[str, dict[str, Any]], columns: tuple[tuple[str, str, str], ...]) -> list[str]:
    lines = [
        "| policy | " + " | ".join(h for _, h, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, m in rows.items():
        cells = [_fmt(m.get(key), kind) for key, _, kind in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _twin_pace(run: LiveRun) -> str:
    """The report's line on the pace the simulator twin runs at."""
    if run.sim_engine is not None:
        err = run.sim_engine_error
        return (
            f"* the simulator twin's engine is the latency model fitted to the real engine's "
            f"{run.sim_engine_iterations} iterations over tandem's run (their token mix and "
            f"measured time); every policy plans with the profile, as on the real engine. Its "
            f"error per iteration, |predicted ÷ measured − 1|: p50 {err['fitted_p50']:.1%}, p90 "
            f"{err['fitted_p90']:.1%} (the profile at the pace per regime: p50 "
            f"{err['regime_pace_p50']:.1%}, p90 {err['regime_pace_p90']:.1%})"
        )
    if run.sim_regime_pace:
        paces = ", ".join(
            f"{name} {f:.3g}×" for name, f in zip(REGIMES, run.sim_regime_pace, strict=True)
        )
        return (
            f"* the simulator twin runs each batch regime at the real engine's pace over "
            f"tandem's run, measured ÷ predicted ({paces} the profile's time; geometric mean "
            f"{run.sim_pace:.3g}×)"
        )
    return (
        f"* the simulator twin runs {run.sim_pace:.3g}× slower than the profile: the real "
        f"engine's pace as tandem's calibration learned it (`--engine-slowdown` of the twin)"
    )


def _twin_overhead(run: LiveRun) -> str:
    """The report's line on the serving overhead the twin adds."""
    if not run.serving_overhead_s:
        return (
            "* serving overhead: not measured (the engine reports no prefill time); the twin's "
            "times are the engine's iterations alone"
        )
    each = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in run.serving_overhead_s.items())
    return (
        f"* serving overhead (client TTFT less the engine's prefill step, median of "
        f"{SERVING_PROBES} requests on the idle engine before each replay): {each}; the twin "
        f"adds each policy's to its requests' token times"
    )


def report_markdown(run: LiveRun, plots: list[str]) -> str:
    cfg = run.config
    lines = [
        f"`{cfg.command}`",
        "",
        f"# {cfg.workload} ({cfg.variant or 'default'}) on the real engine (SGLang 0.5.23, "
        f"CPU, tiny model) through the gateway",
        "",
        f"* RT rate {run.rt_rate_req_s:.3g} req/s = load {cfg.load:g} × the rate share × "
        f"λ* {run.rt_capacity_req_s:.3g} req/s, measured on the real engine (stock FCFS "
        f"behind the gateway, RT alone, joint attainment ≥ 90 % in a probe as long as the "
        f"simulator's, short probes bracketing it; probes, rate → attainment (window): "
        f"{_probes(run)}); the simulator's λ* for the same workload, profile and request "
        f"slots, at the profile's pace, is {_num(run.sim_capacity_req_s)} req/s"
        if run.rt_capacity_req_s
        else f"* RT rate {run.rt_rate_req_s} req/s (--rt-rate); the simulator's λ* for this "
        f"workload is {_num(run.sim_capacity_req_s)} req/s",
        f"* KV pool {run.kv_capacity_tokens} tokens; arrival window "
        f"{run.workload.window_s} s; seed {cfg.seed}; exact output lengths (ignore_eos)",
        f"* tandem's options: `{json.dumps(run.policy_options)}` (config.yaml's; a row "
        f"`tandem:KEY=VALUE…` runs them with its own on top)",
        *(
            [
                f"* engine slowdown {format_slowdown(cfg.engine_slowdown)}: every policy's "
                f"engine sleeps (K − 1) × each forward pass from its replay's start "
                f"(`engine.slowdown`); λ* and the serving overhead were measured at its own pace"
            ]
            if cfg.engine_slowdown
            else []
        ),
        *_recovery_lines(run),
        _twin_pace(run),
        _twin_overhead(run),
        "",
        "## Real engine",
        "",
        *_table(run.real, LIVE_COLUMNS),
        "",
        *_censored_tail_note(run),
        *tenant_table(run.tenants),
        "## Simulator, same workload",
        "",
        *_table(run.sim, LIVE_COLUMNS),
        "",
        *tenant_table(run.sim_tenants),
        "## Simulator ÷ real",
        "",
    ]
    ratios = sim_real_ratios(run)
    lines += ["| policy | " + " | ".join(RATIO_KEYS) + " |", "|---|" + "---|" * len(RATIO_KEYS)]
    for name, row in ratios.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(row[k], "x") for k in RATIO_KEYS) + " |")
    if run.engine_stats:
        lines += [
            "",
            "## tandem inside the engine (control endpoint `/stats`)",
            "",
            "| policy | " + " | ".join(STAT_KEYS) + " |",
            "|---|" + "---|" * len(STAT_KEYS),
        ]
        for name, stats in run.engine_stats.items():
            cells = [_fmt(stats.get(k), "x" if k.endswith("_frac") else "r") for k in STAT_KEYS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += [_model_error(name, run.real.get(name, {})) for name in run.engine_stats]
        lines += [rechecks_line(name, stats) for name, stats in run.engine_stats.items()]
    if run.failed:
        lines += ["", "## Failed", ""] + [f"* {k}: {v}" for k, v in run.failed.items()]
    lines += ["", *[f"![{p}]({p})" for p in plots], ""]
    return "\n".join(lines)


def _censored_tail_note(run: LiveRun) -> list[str]:
    """A line under the real table naming the runs whose TTFT p99 over all RT requests offered
    is a shed request's censored TTFT (the run's length), not a latency."""
    censored = [
        f"{side} {name}"
        for side, rows in (("real", run.real), ("twin", run.sim))
        for name, m in rows.items()
        if (m.get("rt_shed_rate") or 0.0) > 0.01
    ]
    if not censored:
        return []
    return [
        "* TTFT p99 counts a shed request's TTFT as censored at the run's end; where more than "
        f"1 % of the RT requests offered were shed ({', '.join(censored)}) it is that, not a "
        "latency: `adm. TTFT p99` is the tail of the requests admitted",
        "",
    ]


def _model_error(name: str, metrics: Any) -> str:
    """The report's line on how far *name*'s calibrated latency model was from its iterations."""
    p50, p99 = metrics.get("latency_model_error_p50"), metrics.get("latency_model_error_p99")
    if p50 is None or p99 is None:
        return f"* {name}: no iteration with a prediction was recorded"
    return (
        f"* {name}: the calibrated latency model's error per iteration, |predicted ÷ measured "
        f"− 1| over the {metrics['iterations']} iterations the bench recorded: p50 {p50:.1%}, "
        f"p99 {p99:.1%}"
    )


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def _probes(run: LiveRun) -> str:
    return ", ".join(
        f"{rate:.2f} → {value:.2f} ({window_s:g} s)"
        for rate, value, window_s in run.capacity_probes
    )


def write_live_outputs(run: LiveRun, out_dir: Path) -> list[Path]:
    """Writes results.json, report.md and the PNGs; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(run.series, out_dir, f"{run.workload.name} (real engine)")
    results = out_dir / "results.json"
    results.write_text(json.dumps(results_dict(run), indent=1, default=str) + "\n")
    report = out_dir / "report.md"
    report.write_text(report_markdown(run, plots))
    return [results, report, *(out_dir / p for p in plots)]
