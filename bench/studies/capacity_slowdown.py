"""RT capacity λ* of a workload on an engine K× slower than the profile the policies plan with.

`tandem bench --engine-slowdown K` keeps λ* measured at the profile's pace (so `--load` is the
same RT rate with and without a slowdown); this study measures λ* by the same criterion
(`bench/capacity.py`: stock FCFS, the RT stream alone, ≥ 90 % joint TTFT+TPOT attainment) with
the simulated engine running K× slower — the capacity an admission can at best keep, so the
least share of an offered rate that must be shed is 1 − λ*(K) ÷ offered.

    python -m bench.studies.capacity_slowdown --slowdowns 1,2          # W1, 120 s window
"""

from __future__ import annotations

import argparse
from pathlib import Path

from msgspec.structs import replace as struct_replace

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from bench import capacity as cap
from bench.defaults import DEFAULT_PROFILE
from bench.runner import BenchConfig, _make_policy, build, sim_config


def capacity_at(workload_name: str, slowdown: float, duration_s: float, seed: int) -> float:
    """λ* (req/s) of the workload's RT stream on an engine `slowdown`× slower than profiled."""
    config = BenchConfig(
        workload=workload_name, out_dir=Path("."), duration_s=duration_s, seed=seed
    )
    profile = load_profile(resolve_profile(DEFAULT_PROFILE))
    latency = LatencyModel.fit(profile.samples)
    workload, kv = build(config, latency, profile)
    engine = struct_replace(
        sim_config(profile, kv, workload),
        horizon_s=None,
        engine_slowdown=((0.0, slowdown),) if slowdown != 1.0 else (),
    )

    def attainment(rate: float) -> float:
        value = cap.joint_attainment(
            workload,
            rate,
            make_fcfs=lambda: _make_policy("fcfs", latency),
            latency=latency,
            config=engine,
        )
        print(f"  slowdown {slowdown:g}: {rate:.2f} req/s → joint attainment {value:.3f}")
        return value

    return cap.search_capacity(attainment)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--slowdowns", default="1,2", help="comma-separated factors K ≥ 1")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        factors = [float(k) for k in args.slowdowns.split(",")]
    except ValueError:
        parser.error(f"--slowdowns {args.slowdowns!r}: expected numbers like 1,2")
    if any(k < 1.0 for k in factors):
        parser.error(f"--slowdowns {args.slowdowns!r}: every factor must be ≥ 1")
    found = {k: capacity_at(args.workload, k, args.duration_s, args.seed) for k in factors}
    for k, rate in found.items():
        print(f"{args.workload} λ* at slowdown {k:g}: {rate:.2f} req/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
