"""HyGen's SLO-aware profiling (../shared/digests/003_hygen.md §2.3, §4.1), for both sides of
its experiment: the largest value of one policy parameter whose run keeps every RT SLO metric
of the target within the tolerance of the rt-only run, by binary search. HyGen profiles its
latency budget L this way, and the fixed offline rate of its HyGen* baseline.

    .venv/bin/python -m bench.studies.profile_tolerance [W5] [--load 0.75]
        [--policy fixed-offline --param be_rate_req_s --lo 0 --hi 4.0] [--tolerance 0.05]
        [--steps 10]
    ... --policy tandem-tol5 --param latency_budget_s --lo 0.005 --hi 0.06

Metrics: P99 TBT and mean TTFT (W5's interference target). Prints every probe and the value;
the defaults of `FixedOfflinePolicy.be_rate_req_s` and of `tandem-tol5`'s L are the W5 results.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from backend.policy.latency import LatencyModel
from backend.policy.registry import make_policy
from bench import runner

METRICS = ("rt_tbt_p99_s", "rt_ttft_mean_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default="W5")
    ap.add_argument("--load", type=float, default=0.75)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--policy", default="fixed-offline")
    ap.add_argument("--param", default="be_rate_req_s")
    ap.add_argument("--lo", type=float, default=0.0, help="lowest value (assumed to pass)")
    ap.add_argument("--hi", type=float, default=4.0, help="highest value tried")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rate_box = [0.0]
    original = runner._make_policy

    def make(name: str, latency: LatencyModel) -> Any:
        if name == args.policy:
            return make_policy(name, latency, **{args.param: rate_box[0]})
        return original(name, latency)

    runner._make_policy = make  # type: ignore[assignment]
    base = runner.BenchConfig(
        workload=args.workload, out_dir=Path("/dev/null"), load=args.load, progress=False
    )
    reference = (
        runner.run_bench(runner.BenchConfig(**{**base.__dict__, "policies": ("rt-only",)}))
        .runs["rt-only"]
        .metrics
    )

    def ok(rate: float) -> bool:
        rate_box[0] = rate
        run = runner.run_bench(runner.BenchConfig(**{**base.__dict__, "policies": (args.policy,)}))
        m = run.runs[args.policy].metrics
        ratios = {k: float(m[k]) / float(reference[k]) for k in METRICS}
        good = all(r <= 1 + args.tolerance for r in ratios.values())
        print(
            f"{args.param} {rate:.4f}: BE {float(m['be_throughput_tok_s']):.1f} tok/s, "
            + ", ".join(f"{k} ×{v:.3f}" for k, v in ratios.items())
            + (" ok" if good else " over"),
            flush=True,
        )
        return good

    lo, hi = args.lo, args.hi
    if ok(hi):
        lo = hi
    else:
        for _ in range(args.steps):
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    print(f"profiled {args.param}: {lo:.4f}")


if __name__ == "__main__":
    main()
