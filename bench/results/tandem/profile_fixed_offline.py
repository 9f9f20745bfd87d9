"""Profiles the `fixed-offline` baseline's BE admission rate the way HyGen profiles HyGen*
(../shared/digests/003_hygen.md §4.1 and §2.3): the largest fixed offline rate whose run keeps
every RT SLO metric of the target within the tolerance of the rt-only run, by binary search.

    .venv/bin/python bench/results/tandem/profile_fixed_offline.py [W5] [--load 0.75]
        [--tolerance 0.05] [--hi 4.0] [--steps 10]

Metrics: P99 TBT and mean TTFT (W5's interference target). Prints every probe and the rate;
the default of `FixedOfflinePolicy.be_rate_req_s` is the W5 result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from backend.policy.baselines.two_phase import FixedOfflinePolicy  # noqa: E402
from backend.policy.latency import LatencyModel  # noqa: E402
from bench import runner  # noqa: E402

METRICS = ("rt_tbt_p99_s", "rt_ttft_mean_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default="W5")
    ap.add_argument("--load", type=float, default=0.75)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--hi", type=float, default=4.0, help="highest rate tried, req/s")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rate_box = [0.0]
    original = runner._make_policy

    def make(name: str, latency: LatencyModel) -> Any:
        if name == "fixed-offline":
            return FixedOfflinePolicy(latency, be_rate_req_s=rate_box[0])
        return original(name, latency)

    runner._make_policy = make  # type: ignore[assignment]
    base = runner.BenchConfig(workload=args.workload, out_dir=Path("/dev/null"),
                              load=args.load, progress=False)
    reference = runner.run_bench(runner.BenchConfig(
        **{**base.__dict__, "policies": ("rt-only",)})).runs["rt-only"].metrics

    def ok(rate: float) -> bool:
        rate_box[0] = rate
        run = runner.run_bench(runner.BenchConfig(**{**base.__dict__,
                                                     "policies": ("fixed-offline",)}))
        m = run.runs["fixed-offline"].metrics
        ratios = {k: float(m[k]) / float(reference[k]) for k in METRICS}
        good = all(r <= 1 + args.tolerance for r in ratios.values())
        print(f"rate {rate:.4f} req/s: BE {float(m['be_throughput_tok_s']):.1f} tok/s, "
              + ", ".join(f"{k} ×{v:.3f}" for k, v in ratios.items())
              + (" ok" if good else " over"), flush=True)
        return good

    lo, hi = 0.0, args.hi
    if ok(hi):
        lo = hi
    else:
        for _ in range(args.steps):
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
    print(f"profiled rate: {lo:.4f} req/s")


if __name__ == "__main__":
    main()
