"""Plot series: the small per-policy summaries the report's plots need, computed from one run
(so a bench run never holds every policy's SimResult at once). No matplotlib here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.sim.records import SimResult

QUANTILES = np.linspace(0.0, 100.0, 201)
NUM_BINS = 60


@dataclass
class PolicySeries:
    """What the plots need from one policy's run."""

    ttft_q: list[float] = field(default_factory=list)
    """RT TTFT at QUANTILES, seconds (empty without RT)."""
    tbt_q: list[float] = field(default_factory=list)
    """RT inter-token gaps at QUANTILES, seconds."""
    bin_s: float = 1.0
    """Width of the time bins, seconds."""
    be_tok_s: list[float] = field(default_factory=list)
    """BE output tokens/s per bin."""
    rt_arrival_req_s: list[float] = field(default_factory=list)
    """RT arrivals/s per bin."""
    kv_util: list[float] = field(default_factory=list)
    """Time-weighted mean KV use (fraction of capacity) per bin (NaN when idle)."""


def _quantiles(values: np.ndarray) -> list[float]:
    return np.percentile(values, QUANTILES).tolist() if values.size else []


def compute_series(result: SimResult, span_s: float) -> PolicySeries:
    """The plot series of one run over [0, span_s]."""
    span = max(span_s, 1e-6)
    bin_s = span / NUM_BINS
    edges = np.linspace(0.0, span, NUM_BINS + 1)
    rt = [r for r in result.requests if r.tier == "rt"]
    ttft = np.array(
        [
            (r.first_token_s if r.first_token_s is not None else result.end_s) - r.arrival_s
            for r in rt
        ]
    )
    gaps = [np.diff(np.asarray(r.token_times, dtype=float)) for r in rt]
    tbt = np.concatenate(gaps) if gaps else np.zeros(0)
    be_times = [np.asarray(r.token_times, dtype=float) for r in result.requests if r.tier == "be"]
    be_all = np.concatenate(be_times) if be_times else np.zeros(0)
    be_hist = np.histogram(be_all, bins=edges)[0] / bin_s
    rt_hist = np.histogram([r.arrival_s for r in rt], bins=edges)[0] / bin_s
    log = result.iterations
    start = np.asarray(log.start_s, dtype=float)
    dur = np.asarray(log.duration_s, dtype=float)
    kv = np.asarray(log.kv_used_tokens, dtype=float) / max(1, log.kv_capacity_tokens)
    weight = np.histogram(start, bins=edges, weights=dur)[0]
    kv_sum = np.histogram(start, bins=edges, weights=dur * kv)[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        kv_bins = np.where(weight > 0, kv_sum / np.maximum(weight, 1e-12), np.nan)
    return PolicySeries(
        ttft_q=_quantiles(ttft),
        tbt_q=_quantiles(tbt),
        bin_s=bin_s,
        be_tok_s=be_hist.tolist(),
        rt_arrival_req_s=rt_hist.tolist(),
        kv_util=kv_bins.tolist(),
    )
