"""What a placement decision costs per request at 64 replicas (issue 18: p50 ≤ 100 µs): each
router's `choose` (backend/policy/placement.py) on hand-built replica states, as the gateway and
the simulator's pool call it.

The pool: `--replicas` replicas with seeded random live states (RT and BE queues, decoding
requests, KV use, RT sent since the report); one replica in `--refresh` gets a new report
(its next iteration) before each decision, as the engines' reports arrive. Requests: 60 % RT
with a contract (TTFT 0.4 s, TPOT 0.2 s), 40 % BE, prompts 200–2,000 tokens; half of them carry
one of 200 shared prompt prefixes (a conversation's earlier turns, a batch group), so the
prefix trackers fill as in a long run. Timed: `router.choose` alone.

    python -m bench.studies.placement_cost                       # 64 replicas, 20,000 requests
    python -m bench.studies.placement_cost --out bench/results/placement
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backend.policy.feasibility import Backlog, SloAsk, SloForecaster
from backend.policy.latency import LatencyModel, load_profile
from backend.policy.placement import ROUTERS, PlaceAsk, Replica, make_router, prefix_keys
from backend.policy.profiles import resolve_profile
from common.wire import EngineLoad

PROFILE = "h100-llama8b-analytic"
KV_TOKENS = 400_000
BLOCK_TOKENS = 512


def random_load(rng: random.Random, iteration: int) -> EngineLoad:
    """A replica's report: a busy but not swamped H100 engine."""
    rt_running = rng.randint(0, 60)
    rt_waiting = rng.randint(0, 6)
    be_running = rng.randint(0, 120)
    be_waiting = rng.randint(0, 200)
    return EngineLoad(
        iteration=iteration,
        at_unix_s=0.0,
        iteration_s=rng.uniform(0.01, 0.05),
        num_rt_waiting=rt_waiting,
        rt_waiting_prompt_tokens=rt_waiting * rng.randint(100, 1500),
        num_rt_running=rt_running,
        rt_context_tokens=rt_running * rng.randint(200, 1500),
        num_be_waiting=be_waiting,
        be_waiting_prompt_tokens=be_waiting * rng.randint(500, 1000),
        num_be_running=be_running,
        be_context_tokens=be_running * rng.randint(500, 1100),
        kv_used_tokens=rng.randint(0, KV_TOKENS),
        kv_capacity_tokens=KV_TOKENS,
        max_prefill_tokens=8192,
        latency_factors=(rng.uniform(0.9, 1.2), rng.uniform(0.9, 1.2), rng.uniform(0.9, 1.2)),
        calibration_samples=1000,
    )


def random_replica(rng: random.Random, name: str, iteration: int) -> Replica:
    sent = rng.randint(0, 3)
    backlog = Backlog(num_requests=sent, prompt_tokens=sent * rng.randint(100, 1000))
    return Replica(name=name, load=random_load(rng, iteration), backlog=backlog)


def random_ask(rng: random.Random) -> PlaceAsk:
    prompt = rng.randint(200, 2000)
    keys: tuple[int, ...] = ()
    if rng.random() < 0.5:
        group = rng.randrange(200)
        shared = prefix_keys([group * 1000 + b for b in range(prompt // BLOCK_TOKENS)])
        keys = shared
    if rng.random() < 0.6:
        slo = SloAsk(prompt_tokens=prompt, ttft_target_s=0.4, tpot_target_s=0.2)
        return PlaceAsk("rt", prompt, keys, BLOCK_TOKENS, slo)
    return PlaceAsk("be", prompt, keys, BLOCK_TOKENS)


def measure(name: str, replicas: int, requests: int, refresh: int, seed: int) -> dict[str, Any]:
    """One router's decision times, µs (the first 2.5 % are warm-up, not counted)."""
    profile = load_profile(resolve_profile(PROFILE))
    router = make_router(name, SloForecaster(LatencyModel.fit(profile.samples)))
    rng = random.Random(seed)
    pool = [random_replica(rng, f"r{i}", 1) for i in range(replicas)]
    asks = [random_ask(rng) for _ in range(requests)]
    times: list[float] = []
    chosen = [0] * replicas
    for ask in asks:
        for _ in range(max(1, replicas // refresh)):
            i = rng.randrange(replicas)
            iteration = pool[i].load.iteration + 1 if pool[i].load else 1
            pool[i] = random_replica(rng, f"r{i}", iteration)
        t0 = time.perf_counter()
        decision = router.choose(ask, pool)
        times.append((time.perf_counter() - t0) * 1e6)
        chosen[decision.index] += 1
    counted = times[len(times) // 40 :]
    return {
        "router": name,
        "replicas": replicas,
        "requests": len(counted),
        "p50_us": round(statistics.median(counted), 2),
        "p99_us": round(sorted(counted)[int(0.99 * len(counted))], 2),
        "mean_us": round(statistics.fmean(counted), 2),
        "replicas_used": sum(1 for c in chosen if c),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.placement_cost")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument(
        "--refresh", type=int, default=64, help="one replica in N reports anew per request"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for result.json")
    args = parser.parse_args(argv)
    rows = [measure(n, args.replicas, args.requests, args.refresh, args.seed) for n in ROUTERS]
    print("| router | replicas | requests | p50 µs | p99 µs | mean µs | replicas used |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['router']} | {r['replicas']} | {r['requests']} | {r['p50_us']} | "
            f"{r['p99_us']} | {r['mean_us']} | {r['replicas_used']} |"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "command": "python -m bench.studies.placement_cost "
            f"--replicas {args.replicas} --requests {args.requests} --refresh {args.refresh} "
            f"--seed {args.seed} --out {args.out}",
            "target_p50_us": 100,
            "rows": rows,
            "host": f"{platform.machine()}, Python {platform.python_version()}",
            "at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        }
        (args.out / "placement_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
