"""How much RT traffic each router lets a pool carry within the contract (issue 18).

At a fixed rate below the pool's capacity every router serves nearly every request, so the RT
goodput of one run (requests per second that met TTFT and TPOT) cannot differ by much between
routers: at 0.75 of the capacity the Azure conversation trace gives round-robin 98.9 % joint
attainment, so no router can beat its goodput there by more than 1 ÷ 0.989. What an operator
buys a better router for is the other question: **how much more traffic the same replicas take
before the contract breaks** — DistServe's goodput, the largest request rate served with the SLO
attainment goal met.

For each router this study replays one trace on the simulated pool (`bench.runner.run_bench`,
the same runs as `tandem bench trace … --replicas N --routers R`) at each rate scale of a grid,
and reports the joint attainment over every RT request offered (a shed request counts as a
miss), the RT goodput, and the router's capacity: the largest rate scale of the grid up to which
every run met `--goal` (0.99 by default). A run is a few seconds to a minute of CPU.

    python -m bench.trace convert-azure bench/data/azure_llm_2023_conv.csv \\
        /tmp/azure_conv_turns4.jsonl --mean-turns 4
    python -m bench.studies.router_capacity /tmp/azure_conv_turns4.jsonl \\
        --routers slo,round-robin --scales 24,28,32,36,40,44,48,52,56 \\
        --out bench/results/placement/capacity-azure-replicas8
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.runner import BenchConfig, run_bench

GOAL = 0.99
"""Joint attainment (TTFT and TPOT met, over every RT request offered) a rate must keep."""


def probe(
    trace: Path, router: str, rate_scale: float, replicas: int, slowdowns: tuple[float, ...]
) -> dict[str, Any]:
    """One simulated run of the trace at `rate_scale` on `replicas` replicas behind `router`."""
    config = BenchConfig(
        workload="trace",
        out_dir=Path("."),
        trace_file=trace,
        rate_scale=rate_scale,
        replicas=replicas,
        routers=(router,),
        replica_slowdowns=slowdowns,
        progress=False,
    )
    run = run_bench(config)
    if router in run.failed:
        raise RuntimeError(f"router {router} at rate ×{rate_scale:g}: {run.failed[router]}")
    metrics = run.runs[router].metrics
    return {
        "rate_scale": rate_scale,
        "rt_requests": metrics["rt_requests"],
        "rt_joint_attainment": metrics["rt_joint_attainment"],
        "rt_admitted_attainment": metrics["rt_admitted_attainment"],
        "rt_shed_rate": metrics["rt_shed_rate"],
        "rt_goodput_req_s": metrics["rt_goodput_req_s"],
        "rt_ttft_p99_s": metrics["rt_ttft_p99_s"],
    }


def capacity(rows: list[dict[str, Any]], goal: float) -> dict[str, Any] | None:
    """The row of the largest rate scale up to which every run (ascending) met `goal`;
    None when even the smallest did not."""
    best = None
    for row in sorted(rows, key=lambda r: r["rate_scale"]):
        if row["rt_joint_attainment"] is None or row["rt_joint_attainment"] < goal:
            break
        best = row
    return best


def _parse_floats(text: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SystemExit(f"{option} {text!r}: give comma-separated numbers") from None
    if not values or any(value <= 0 for value in values):
        raise SystemExit(f"{option} {text!r}: give numbers > 0")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a trace file (bench.trace format)")
    parser.add_argument("--routers", default="slo,round-robin")
    parser.add_argument("--scales", default="24,28,32,36,40,44,48,52,56")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument(
        "--replica-slowdowns",
        default="",
        help="replica i runs this many times slower (comma-separated; default all 1)",
    )
    parser.add_argument("--goal", type=float, default=GOAL)
    parser.add_argument("--out", type=Path, default=None, help="folder for capacity.json")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        raise SystemExit(f"trace {args.trace}: no such file")
    if not 0 < args.goal <= 1:
        raise SystemExit(f"--goal {args.goal}: give a share in (0, 1]")
    scales = sorted(_parse_floats(args.scales, "--scales"))
    slowdowns = (
        _parse_floats(args.replica_slowdowns, "--replica-slowdowns")
        if args.replica_slowdowns
        else ()
    )
    routers = [name.strip() for name in args.routers.split(",") if name.strip()]
    results: dict[str, Any] = {}
    for router in routers:
        rows = []
        for scale in scales:
            row = probe(args.trace, router, scale, args.replicas, slowdowns)
            rows.append(row)
            print(
                f"{router:12s} ×{scale:<5g} joint {row['rt_joint_attainment']:.4f} "
                f"shed {row['rt_shed_rate']:.4f} goodput {row['rt_goodput_req_s']:.1f} req/s",
                flush=True,
            )
        best = capacity(rows, args.goal)
        results[router] = {
            "runs": rows,
            "capacity_rate_scale": None if best is None else best["rate_scale"],
            "goodput_at_capacity_req_s": None if best is None else best["rt_goodput_req_s"],
        }
    print(f"\ncapacity at joint attainment ≥ {args.goal:g} (grid {args.scales}):")
    for router, result in results.items():
        print(
            f"  {router:12s} rate ×{result['capacity_rate_scale']}  "
            f"goodput {result['goodput_at_capacity_req_s']} req/s"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        document = {
            "trace": args.trace.name,
            "replicas": args.replicas,
            "replica_slowdowns": list(slowdowns),
            "goal_joint_attainment": args.goal,
            "scales": scales,
            "routers": results,
            "command": " ".join(["python -m bench.studies.router_capacity", *sys.argv[1:]]),
            "host": platform.node(),
            "when": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        path = args.out / "capacity.json"
        path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
