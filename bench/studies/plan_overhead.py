"""Planning overhead of a policy at scale: `plan()` wall time with 256 running and 2,000
waiting requests (issue 4, item 6: median ≤ 1 ms for `tandem`).

The snapshots are real: the simulator's engine core executes every plan, so the policy's
incremental structures (queues, kept length samples) see the steady state they would see in a
run, not the same snapshot again and again. New requests top the waiting queue back up every
iteration (half RT chat, half BE documents), and the engine's `max_running` holds the running
set at the target, so every measured plan faces `--running` running and `--waiting` waiting
requests.

    python -m bench.studies.plan_overhead                       # tandem, 256 running, 2,000 waiting
    python -m bench.studies.plan_overhead --policy fcfs --iterations 500
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import PROFILES_DIR
from backend.policy.registry import make_policy
from backend.policy.types import FinishedRequest, IterationResult
from backend.sim.config import SimConfig
from backend.sim.core import EngineCore
from backend.sim.source import SimRequest
from bench.defaults import DEFAULT_PROFILE


def _request(rng: random.Random, serial: int, now_s: float) -> SimRequest:
    """Half RT chat (ShareGPT-like lengths, TTFT 0.4 s / TPOT 0.2 s), half BE documents."""
    if serial % 2:
        return SimRequest(
            rid=f"rt{serial}",
            tier="rt",
            arrival_s=now_s,
            prompt_len=rng.randint(20, 800),
            output_len=rng.randint(20, 400),
            max_new_tokens=2048,
            ttft_target_s=0.4,
            tpot_target_s=0.2,
            length_key="chat",
        )
    return SimRequest(
        rid=f"be{serial}",
        tier="be",
        arrival_s=now_s,
        prompt_len=rng.randint(512, 1024),
        output_len=rng.randint(32, 128),
        max_new_tokens=128,
        length_key="docs",
        order_key=float(serial),
    )


def measure(
    policy_name: str, *, running: int, waiting: int, iterations: int, warmup: int, seed: int = 0
) -> dict[str, float]:
    """Plan times (ms) over `iterations` measured iterations after `warmup` ones."""
    profile = load_profile(PROFILES_DIR / f"{DEFAULT_PROFILE}.json")
    latency = LatencyModel.fit(profile.samples)
    policy = make_policy(policy_name, latency)
    core = EngineCore(
        SimConfig(
            kv_capacity_tokens=profile.kv_capacity_tokens, max_running=running, prefix_cache=False
        ),
        policy.name,
    )
    rng = random.Random(seed)
    serial = itertools.count()
    now = 0.0
    times: list[float] = []
    sizes: list[tuple[int, int]] = []
    for i in range(warmup + iterations):
        while len(core.waiting) < waiting:
            core.add(_request(rng, next(serial), now))
        snap = core.snapshot(now)
        started = time.perf_counter()
        plan = policy.plan(snap)
        elapsed = time.perf_counter() - started
        if i >= warmup:
            times.append(elapsed * 1000.0)
            sizes.append((len(snap.running), len(snap.waiting)))
        batch = core.apply(plan, now)
        duration = latency.predict(batch.shape)
        emitted, finished = core.finish(batch, now + duration)
        policy.observe(
            IterationResult(
                start_s=now,
                duration_s=duration,
                plan=plan,
                emitted=emitted,
                finished=[
                    FinishedRequest(
                        t.state.rid, t.state.tier, t.state.length_key, t.state.generated
                    )
                    for t in finished
                ],
            )
        )
        now += max(duration, 1e-3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * len(times))],
        "p99_ms": times[int(0.99 * len(times))],
        "mean_ms": statistics.fmean(times),
        "running_mean": statistics.fmean(r for r, _ in sizes),
        "waiting_mean": statistics.fmean(w for _, w in sizes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="tandem")
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=2000)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = measure(
        args.policy,
        running=args.running,
        waiting=args.waiting,
        iterations=args.iterations,
        warmup=args.warmup,
        seed=args.seed,
    )
    print(
        f"{args.policy}: plan() over {args.iterations} iterations with "
        f"{out['running_mean']:.0f} running and {out['waiting_mean']:.0f} waiting "
        f"(means): median {out['median_ms']:.3f} ms, p90 {out['p90_ms']:.3f} ms, "
        f"p99 {out['p99_ms']:.3f} ms, mean {out['mean_ms']:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
