"""When the request slots run out, are the admitted RT requests still on time? The SLO
admission's slot wait with output lengths the engine cannot know, in the simulator.

A slot-bound stream: 8 request slots, short RT prompts (50 tokens) arriving as a Poisson stream
faster than slots free up, output lengths drawn per request (uniform 50–250 tokens, or
lognormal with median 120 and σ 0.8, capped at 1,000) while every request's max_new_tokens is
1,000, TTFT 0.5 s, TPOT 0.2 s, judged again at the door for half the TTFT target as the gateway
does (`slo_recheck_frac`). Each row runs tandem with `slo_slot_free_quantile` set to one value
(None: each running decode's mean steps left, the k-th fewest) over the same streams; it counts
the admitted requests and those of them that came late, and the worst lateness. Rows marked
feedback also learn from outcomes as the gateway does (`TtftFeedback`: each admitted request's
first token against its forecast, and a slot wait's decode step scaled by a high quantile of
the engine's mean iteration over the step forecast, at most 1), the gateway's shipped setting
with `slo_slot_wait_feedback`.

It also times what the engine's report pays for it (`RtOutputs.slots_free_steps`) at 8, 64 and
256 running RT decodes, against the mean's.

    python -m bench.studies.slot_wait
    python -m bench.studies.slot_wait --out bench/results/slot_wait
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backend.policy.feasibility import STEPS_LEFT_REPORTED, RtOutputs
from backend.policy.latency import LatencyModel
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.types import ReqState, Snapshot
from backend.sim.config import SimConfig
from backend.sim.engine import simulate
from backend.sim.source import ListSource, SimRequest

LATENCY = LatencyModel([0.010, 0.020, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0])
"""10 ms per iteration + 20 ms per 1K prefill tokens + 1 ms per 1K decode context."""
TTFT_TARGET_S = 0.5
QUANTILES: tuple[float | None, ...] = (None, 0.9, 0.95)
FEEDBACK_QUANTILES: tuple[float | None, ...] = (None, 0.95)
"""The quantiles run again with the outcome feedback on."""
RATES_REQ_S = (10.0, 15.0, 20.0)


def _output_len(rng: random.Random, lengths: str) -> int:
    if lengths == "uniform":
        return rng.randint(50, 250)
    return min(1000, max(4, int(rng.lognormvariate(math.log(120), 0.8))))


def stream(rate_req_s: float, seed: int, lengths: str, requests: int) -> list[SimRequest]:
    """*requests* RT requests at *rate_req_s* (Poisson), outputs per *lengths*."""
    rng = random.Random(f"{lengths}:{rate_req_s}:{seed}")
    out, at_s = [], 0.0
    for i in range(requests):
        at_s += rng.expovariate(rate_req_s)
        out.append(
            SimRequest(
                rid=f"rt{i}",
                tier="rt",
                arrival_s=at_s,
                prompt_len=50,
                output_len=_output_len(rng, lengths),
                max_new_tokens=1000,
                ttft_target_s=TTFT_TARGET_S,
                tpot_target_s=0.2,
            )
        )
    return out


def run_row(
    quantile: float | None, lengths: str, seeds: int, requests: int, feedback: bool = False
) -> dict[str, Any]:
    """The streams of every rate and seed through tandem with *quantile* (and the front door
    learning from outcomes if *feedback*)."""
    offered = admitted = late = 0
    worst = 0.0
    for rate in RATES_REQ_S:
        for seed in range(seeds):
            config = SimConfig(
                kv_capacity_tokens=400_000,
                max_running=8,
                slo_recheck_frac=0.5,
                ttft_feedback=feedback,
            )
            policy = TandemPolicy(
                LATENCY,
                config=TandemConfig(latency_budget_s=0.05, slo_slot_free_quantile=quantile),
            )
            source = ListSource(stream(rate, seed, lengths, requests))
            for r in simulate(source, policy, LATENCY, config).requests:
                offered += 1
                if r.admission == "shed":
                    continue
                admitted += 1
                ttft_s = (r.first_token_s or math.inf) - r.arrival_s
                if ttft_s > TTFT_TARGET_S:
                    late += 1
                    worst = max(worst, ttft_s / TTFT_TARGET_S)
    return {
        "slo_slot_free_quantile": quantile,
        "ttft_feedback": feedback,
        "lengths": lengths,
        "offered": offered,
        "admitted": admitted,
        "admitted_late": late,
        "late_share_of_admitted": round(late / max(1, admitted), 4),
        "worst_late_ttft_x_target": round(worst, 2),
    }


def _snapshot(running: list[ReqState]) -> Snapshot:
    return Snapshot(
        now_s=0.0, waiting=[], running=running, kv_capacity_tokens=1 << 20, kv_free_tokens=1 << 20
    )


def _decoding(rid: str, generated: int) -> ReqState:
    """A running RT request past its 50-token prompt, *generated* tokens out of at most 4,096."""
    return ReqState(
        rid=rid,
        tier="rt",
        arrival_s=0.0,
        prompt_len=50,
        max_new_tokens=4096,
        prefill_len=50,
        prefilled=50,
        generated=generated,
        is_running=True,
    )


def report_cost(decodes: int, quantile: float | None, repeats: int = 200) -> float:
    """µs per `slots_free_steps` call with *decodes* running RT decodes (p50)."""
    rng = random.Random(decodes)
    outputs = RtOutputs(quantile=quantile)
    finished = [
        _decoding(f"f{i}", max(4, int(rng.lognormvariate(5.0, 0.8))) - 1) for i in range(256)
    ]
    outputs.observe(_snapshot(finished))
    outputs.observe(_snapshot([]))
    decoding = [_decoding(f"d{i}", rng.randint(0, 300)) for i in range(decodes)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs.slots_free_steps(decoding, STEPS_LEFT_REPORTED)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="streams per rate (default 3)")
    parser.add_argument("--requests", type=int, default=400, help="per stream (default 400)")
    parser.add_argument("--out", type=Path, help="write result.json here")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.requests < 1:
        parser.error("--seeds and --requests must be ≥ 1")
    rows = [
        run_row(q, lengths, args.seeds, args.requests, feedback)
        for lengths in ("uniform", "lognormal")
        for feedback, quantiles in ((False, QUANTILES), (True, FEEDBACK_QUANTILES))
        for q in quantiles
    ]
    print("lengths    quantile  feedback  offered  admitted  late  late/admitted  worst late")
    for row in rows:
        print(
            f"{row['lengths']:10s} {row['slo_slot_free_quantile']!s:8s}"
            f" {'on' if row['ttft_feedback'] else 'off':>8s} {row['offered']:8d}"
            f" {row['admitted']:9d} {row['admitted_late']:5d} {row['late_share_of_admitted']:14.4f}"
            f" {row['worst_late_ttft_x_target']:9.2f}×"
        )
    cost = {str(n): {str(q): report_cost(n, q) for q in (None, 0.95)} for n in (8, 64, 256)}
    print("report cost, µs p50 per call (running RT decodes: mean / quantile 0.95):")
    for n, by_q in cost.items():
        print(f"  {n:>4s}: {by_q['None']} / {by_q['0.95']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "study": "slot_wait",
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "seeds": args.seeds,
            "requests_per_stream": args.requests,
            "rates_req_s": list(RATES_REQ_S),
            "rows": rows,
            "report_cost_us_p50": cost,
        }
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out / 'result.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
