"""Writes a `tandem plan` result: plan.json, the table on stdout, and the PNG of attainment and
cost against the replica count (matplotlib's Agg backend, bench/plots.py's conventions)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.plan import Plan, Trial
from bench.plots import DPI, FIGSIZE

PLOT_FILE = "plan.png"


def plan_dict(plan: Plan) -> dict[str, Any]:
    """plan.json: the answer first, then one row per replica count tried (in count order)."""
    cfg = plan.config
    return {
        "replicas_needed": plan.replicas_needed,
        "target_attainment": cfg.target,
        "trace_file": str(cfg.trace_file),
        "tenants_file": None if cfg.tenants_file is None else str(cfg.tenants_file),
        "profile": plan.profile.name,
        "engine_policy": cfg.policy,
        "router": cfg.router,
        "requests": plan.requests,
        "duration_s": plan.duration_s,
        "judged_window": None if plan.window is None else plan.window.row(),
        "sample_replicas": cfg.sample_replicas,
        "max_replicas": cfg.max_replicas,
        "rows": [plan.trials[n].row() for n in sorted(plan.trials)],
        "command": cfg.command,
        "run_info": {
            "note": "wall-clock and CPU times differ between identical runs",
            "wall_s": round(plan.wall_s, 3),
            "cpu_s": round(plan.cpu_s, 3),
        },
    }


def percent(share: float, *, upper_bound: bool = False) -> str:
    """A share as a percentage, rounded down (0.98995 is 98.99 %, not a 99.00 % that would read
    as meeting a 99 % target); an upper bound (a run stopped early) is shown as "≤ x %"."""
    shown = f"{math.floor(10000 * share) / 100:.2f} %"
    return f"≤ {shown}" if upper_bound else shown


def table(plan: Plan) -> str:
    """The rows as a Markdown table (stdout and report)."""
    names = list(next(iter(plan.trials.values())).tenants) if plan.trials else []
    head = ["replicas", "simulated", *[f"{n} att." for n in names], "cost replica·h", "meets"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in sorted(plan.trials):
        t = plan.trials[n]
        cells = [str(n), str(t.simulated_replicas)]
        for name in names:
            att = t.tenants[name]["attainment"]
            judged = "" if t.tenants[name]["judged"] else " (no contract)"
            shown = "–" if att is None else percent(att, upper_bound=t.stopped_early)
            cells.append(shown + judged)
        cells.append(f"{n * plan.duration_s / 3600.0:.3g}")
        cells.append("yes" if t.meets else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(plan: Plan) -> str:
    """One line: the answer."""
    cfg = plan.config
    if plan.replicas_needed is None:
        return (
            f"no pool of up to {cfg.max_replicas} replicas meets every tenant's contract at "
            f"{cfg.target:.0%} attainment"
        )
    w = plan.window
    judged = (
        ""
        if w is None
        else f"; judged on the busiest {w.end_s - w.start_s:.0f} s of the trace, "
        f"{w.start_s:.0f}–{w.end_s:.0f} s ({w.row()['peak_to_mean']:.2f}× its mean load, "
        f"after {w.warmup_s:.0f} s of warm-up; --window-s 0 judges all of it)"
    )
    return (
        f"{plan.replicas_needed} replicas meet every tenant's contract at ≥ {cfg.target:.0%} "
        f"attainment ({cfg.policy} engines, {cfg.router} placement, profile "
        f"{plan.profile.name}; {len(plan.trials)} counts simulated in {plan.wall_s:.0f} s, "
        f"{plan.cpu_s:.0f} s of CPU{judged})"
    )


def _plot(plan: Plan, path: Path) -> None:
    counts = sorted(plan.trials)
    trials: list[Trial] = [plan.trials[n] for n in counts]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    names = list(trials[0].tenants) if trials else []
    for name in names:
        if not trials[0].tenants[name]["judged"]:
            continue
        values = [t.tenants[name]["attainment"] for t in trials]
        ax.plot(counts, [100 * (v or 0.0) for v in values], marker="o", label=name)
    ax.axhline(100 * plan.config.target, color="black", linestyle="--", linewidth=1,
               label=f"target {plan.config.target:.0%}")  # fmt: skip
    if plan.replicas_needed is not None:
        ax.axvline(plan.replicas_needed, color="green", linestyle=":", linewidth=1.5,
                   label=f"needed: {plan.replicas_needed}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("replicas")
    ax.set_ylabel("attainment, % of the tenant's requests")
    twin = ax.twinx()
    twin.plot(counts, [n * plan.duration_s / 3600.0 for n in counts], color="grey",
              linestyle="-.", linewidth=1, label="cost")  # fmt: skip
    twin.set_ylabel("cost, replica-hours (dash-dot)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"plan: attainment and cost against replicas ({plan.config.router} placement)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write_plan(plan: Plan, out_dir: Path) -> list[Path]:
    """Writes plan.json and the PNG into *out_dir*; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "plan.json"
    path.write_text(json.dumps(plan_dict(plan), indent=1) + "\n")
    png = out_dir / PLOT_FILE
    _plot(plan, png)
    return [path, png]
