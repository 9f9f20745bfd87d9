"""Where the bicache layout's time goes: tandem on the token pool vs on the bidirectional
layout (backend/sim/bikv.py), side by side, with the engine counters the bench report does not
show (checkpointed and restored tokens, engine retractions, recomputed prompt tokens) and what
they cost in engine time.

    python -m bench.studies.bicache_ablation               # W1, load 0.75, --kv-scale 1.5 2 3
    python -m bench.studies.bicache_ablation --loads 0.5 0.75 --kv-scales 1.5 --json out.json

Recompute time is an estimate: recomputed tokens × the latency model's marginal prefill cost per
token (a 512-token chunk); copy time is exact (the simulator charges it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from msgspec.structs import replace as struct_replace

from backend.policy.latency import BatchShape, LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from backend.policy.registry import make_policy
from backend.sim.engine import simulate
from backend.sim.source import SimRequest
from bench.defaults import DEFAULT_PROFILE
from bench.metrics import compute_metrics
from bench.runner import BenchConfig, build, measure_rate, sim_config
from bench.workloads.sources import SimSource

LAYOUTS = {"token": "tandem-no-bicache", "bicache": "tandem-bicache"}


def _marginal_prefill_s(latency: LatencyModel) -> float:
    """Seconds one more prompt token costs in a 512-token prefill chunk."""

    def t(n: int) -> float:
        return latency.predict(
            BatchShape(
                prefill_tokens=n, num_prefill=1, prefill_attn=float(n * n), prefill_attn_full=n * n
            )
        )

    return (t(512) - t(1)) / 511


def run_cell(
    workload_name: str,
    load: float,
    kv_scale: float,
    seed: int,
    profile_name: str,
    cache_dir: Path,
    report: str = "placeable",
) -> list[dict[str, Any]]:
    """Both layouts at one (load, kv-scale) point."""
    cfg = BenchConfig(
        workload=workload_name,
        out_dir=Path("/dev/null"),
        load=load,
        kv_scale=kv_scale,
        seed=seed,
        profile=profile_name,
        progress=False,
        cache_dir=cache_dir,
    )
    profile_path = resolve_profile(cfg.profile)
    profile = load_profile(profile_path)
    latency = LatencyModel.fit(profile.samples)
    workload, kv = build(cfg, latency, profile)
    base = sim_config(profile, kv, workload)
    _, _, rate = measure_rate(cfg, workload, latency, profile_path, base)
    per_token = _marginal_prefill_s(latency)
    copy_s = (profile.kv_bytes_per_token or base.kv_bytes_per_token) / (
        (profile.host_copy_gb_s or base.host_copy_gb_s) * 1e9
    )
    rows = []
    for layout, name in LAYOUTS.items():
        config = (
            base
            if layout == "token"
            else struct_replace(
                base,
                kv_layout="bicache",
                prefix_cache=False,
                bicache_report=report,
                kv_bytes_per_token=profile.kv_bytes_per_token or base.kv_bytes_per_token,
                host_copy_gb_s=profile.host_copy_gb_s or base.host_copy_gb_s,
            )
        )
        source = SimSource(workload.source(rate, True), SimRequest)
        result = simulate(source, make_policy(name, latency), latency, config)
        metrics = compute_metrics(result, workload.window_s)
        admitted = [r for r in result.requests if r.admitted_s is not None]
        computed = sum(result.iterations.prefill_tokens)
        prompts = sum(r.prompt_len for r in admitted)
        stats = result.kv_layout_stats
        copied = stats.get("checkpointed_tokens", 0) + stats.get("restored_tokens", 0)
        busy = sum(result.iterations.duration_s)
        rows.append(
            {
                "load": load,
                "kv_scale": kv_scale,
                "kv_tokens": kv,
                "layout": layout,
                "rt_ttft_attainment": metrics["rt_ttft_attainment"],
                "rt_tpot_attainment": metrics["rt_tpot_attainment"],
                "be_tok_s": metrics["be_throughput_tok_s"],
                "evictions": result.num_evictions,
                "engine_retractions": stats.get("engine_retractions", 0),
                "recomputed_tokens": computed - prompts,
                "recompute_s_est": (computed - prompts) * per_token,
                "copied_tokens": copied,
                "copy_s": copied * copy_s,
                "busy_s": busy,
                **{k: v for k, v in stats.items() if k != "engine_retractions"},
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("load", "{:g}"),
        ("kv_scale", "{:g}"),
        ("layout", "{}"),
        ("rt_ttft_attainment", "{:.1%}"),
        ("rt_tpot_attainment", "{:.1%}"),
        ("be_tok_s", "{:.0f}"),
        ("evictions", "{}"),
        ("engine_retractions", "{}"),
        ("recomputed_tokens", "{}"),
        ("recompute_s_est", "{:.2f}"),
        ("copied_tokens", "{}"),
        ("copy_s", "{:.3f}"),
        ("busy_s", "{:.1f}"),
    ]
    out = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(fmt.format(r[c]) for c, fmt in cols) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.bicache_ablation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", default="W1")
    p.add_argument("--loads", type=float, nargs="+", default=[0.75])
    p.add_argument("--kv-scales", type=float, nargs="+", default=[1.5, 2.0, 3.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "tandem")
    p.add_argument(
        "--report",
        choices=("placeable", "slots"),
        default="placeable",
        help="what the bicache engine reports as free KV (SimConfig.bicache_report)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for load in args.loads:
        for kv_scale in args.kv_scales:
            rows += run_cell(
                args.workload, load, kv_scale, args.seed, args.profile, args.cache_dir, args.report
            )
            print(f"done load {load:g} kv-scale {kv_scale:g}", file=sys.stderr)
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
