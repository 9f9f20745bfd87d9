"""The PNG plots of a report: RT TTFT and TBT CDFs, BE throughput over time against the RT
arrival rate, KV use over time (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from bench.series import QUANTILES, PolicySeries

DPI = 80
FIGSIZE = (7.0, 4.0)
PLOT_FILES = ("rt_ttft_cdf.png", "rt_tbt_cdf.png", "be_throughput.png", "kv_use.png")


def _cdf_plot(series: dict[str, PolicySeries], attr: str, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE)
    drawn = False
    for name, s in series.items():
        values = np.asarray(getattr(s, attr), dtype=float)
        if values.size:
            ax.plot(np.maximum(values, 1e-4), QUANTILES / 100.0, label=name)
            drawn = True
    if drawn:
        ax.set_xscale("log")
        ax.legend(fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no RT requests", ha="center", transform=ax.transAxes)
    ax.set_xlabel("seconds (log scale)")
    ax.set_ylabel("fraction of RT " + ("requests" if "ttft" in attr else "token gaps"))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _time_plot(series: dict[str, PolicySeries], path: Path, *, be: bool, title: str) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE)
    rt_rate = None
    for name, s in series.items():
        t = (np.arange(len(s.be_tok_s)) + 0.5) * s.bin_s
        if be and not any(s.be_tok_s):
            continue  # rt-only: no BE line
        ax.plot(t, s.be_tok_s if be else s.kv_util, label=name, linewidth=1)
        if any(s.rt_arrival_req_s):
            rt_rate = (t, s.rt_arrival_req_s)
    ax.set_xlabel("simulated time, s")
    ax.set_ylabel("BE output tokens/s" if be else "KV in use (fraction of capacity)")
    if be and rt_rate is not None:
        twin = ax.twinx()
        twin.plot(*rt_rate, color="black", linestyle=":", linewidth=1.5, label="RT arrivals")
        twin.set_ylabel("RT arrivals/s (dotted)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no BE requests", ha="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write_plots(series: dict[str, PolicySeries], out_dir: Path, label: str) -> list[str]:
    """Writes the four PNGs into out_dir; returns their file names."""
    out_dir = Path(out_dir)
    _cdf_plot(series, "ttft_q", f"{label}: RT time to first token (CDF)", out_dir / PLOT_FILES[0])
    _cdf_plot(series, "tbt_q", f"{label}: RT time between tokens (CDF)", out_dir / PLOT_FILES[1])
    _time_plot(
        series, out_dir / PLOT_FILES[2], be=True, title=f"{label}: BE throughput vs RT arrival rate"
    )
    _time_plot(series, out_dir / PLOT_FILES[3], be=False, title=f"{label}: KV use over time")
    return list(PLOT_FILES)
