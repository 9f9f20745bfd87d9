"""Tandem's planning cost per iteration inside SGLang's scheduler: `EngineDriver.plan_iteration`
(the snapshot of every request, the policy's plan, the directive) on stand-ins for SGLang's
objects, at the sizes an engine meets.

`plan_overhead` times the policy's `plan()` alone on the simulator's snapshots; on the real
engine the driver also mirrors every waiting and running request into the policy's view each
iteration, and that part grows with the queue. Here the stand-ins churn as an engine does:
every row the plan decodes emits a token, a finished request leaves (its slot goes to the
request the plan admits) and as many new requests arrive, so the mirror and the policy meet
new, admitted, parked and finished requests every iteration, not one frozen state.

    python -m bench.studies.driver_overhead                    # the four shapes below
    python -m bench.studies.driver_overhead --shape 256x2000 --iterations 500

Shapes (running × waiting, as offered): `new-user` is the new user's chat beside a 50-line batch
(one RT chat, 35 BE lines running and 15 waiting to start with); `64x64` a busy small engine;
`256x2000` issue 4's planning scale (a long BE queue behind a full engine); `rt-256` all 256
slots RT chats, each finished one replaced by a new chat (the engine's load report then also
says when slots free up, for the gateway's SLO admission). The running cap is the shape's
running count; how many run from there on is the policy's choice (it parks BE rows and admits BE
prompts within its time budget), so the bench prints the mean running and waiting counts it
measured at.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import PROFILES_DIR
from backend.policy.registry import make_policy
from backend.sglang_ext.driver import EngineDriver
from backend.sglang_ext.request_meta import REQ_ATTR, meta_of
from common.wire import RequestMeta, meta_to_custom_params

PROFILE = "cpu-tiny"
"""The profile the policy plans with (the CPU engine's; the cost is Python, not the model)."""
SHAPES: dict[str, tuple[int, int, int]] = {
    "new-user": (1, 35, 15),
    "64x64": (8, 56, 64),
    "256x2000": (64, 192, 2000),
    "rt-256": (256, 0, 0),
}
"""Shape name → (RT running, BE running, BE waiting)."""
SHAPE_PROFILES = {"rt-256": "h100-llama8b-analytic"}
"""Shapes planned with another profile than `PROFILE`: 256 RT decodes keep their TPOT on a
GPU's pace, not on the CPU engine's (where the policy runs a few dozen and queues the rest)."""


@dataclass(eq=False)
class _Req:
    """The part of SGLang's ``Req`` the driver reads (``backend.sglang_ext.views.ReqView``)."""

    rid: str
    origin_input_ids: list[int]
    output_len: int
    sampling_params: Any
    output_ids: list[int] = field(default_factory=list)
    kv: Any = None
    prefix_len: int = 0
    cached_tokens: int = 0
    retraction_count: int = 0
    inflight_middle_chunks: int = 0
    finished_reason: Any = None

    def finished(self) -> bool:
        return self.finished_reason is not None


class _Batch:
    """The part of SGLang's ``ScheduleBatch`` the driver reads."""

    def __init__(self) -> None:
        self.reqs: list[_Req] = []


def _request(rng: random.Random, serial: int, tier: str) -> _Req:
    rt = tier == "rt"
    prompt = rng.randint(20, 120) if rt else rng.randint(128, 256)
    meta = RequestMeta(
        tier=tier,  # type: ignore[arg-type]
        tenant_id="chat" if rt else "docs",
        length_key="chat" if rt else "docs",
        arrival_unix_s=time.time(),
        ttft_target_ms=1500.0 if rt else None,
        tpot_target_ms=250.0 if rt else None,
        max_tokens=200,
    )
    req = _Req(
        rid=f"{tier}{serial}",
        origin_input_ids=[1] * prompt,
        output_len=rng.randint(8, 200),
        sampling_params=SimpleNamespace(max_new_tokens=200),
    )
    req.kv = SimpleNamespace(kv_allocated_len=prompt, cache_protected_len=0)
    setattr(req, REQ_ATTR, meta_of(meta_to_custom_params(meta)))
    return req


def measure(shape: str, *, iterations: int, warmup: int, seed: int = 0) -> dict[str, float]:
    """Per-iteration times (µs) of `plan_iteration` and of the policy's `plan()` in it."""
    rt_running, be_running, be_waiting = SHAPES[shape]
    profile = SHAPE_PROFILES.get(shape, PROFILE)
    latency = LatencyModel.fit(load_profile(PROFILES_DIR / f"{profile}.json").samples)
    driver = EngineDriver(make_policy("tandem", latency))
    rng = random.Random(seed)
    serial = itertools.count()
    batch = _Batch()
    batch.reqs = [_request(rng, next(serial), "rt") for _ in range(rt_running)]
    batch.reqs += [_request(rng, next(serial), "be") for _ in range(be_running)]
    for req in batch.reqs:
        req.output_ids.append(2)  # admitted earlier: prefilled, decoding
    capacity = 10_000_000
    sched = SimpleNamespace(
        waiting_queue=[_request(rng, next(serial), "be") for _ in range(be_waiting)],
        chunked_req=None,
        max_total_num_tokens=capacity,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: capacity // 2),
        tree_cache=SimpleNamespace(evictable_size=lambda: 0, supports_prefix_sharing=lambda: True),
        chunked_prefill_size=2048,
        max_prefill_tokens=16384,
        is_mixed_chunk=False,
        max_running_requests=rt_running + be_running,  # holds the running set at its size
        page_size=1,
    )
    total_us: list[float] = []
    sizes: list[tuple[int, int]] = []  # (running, waiting) at each measured plan
    for i in range(warmup + iterations):
        driver.begin_iteration()
        started = time.perf_counter()
        directive = driver.plan_iteration(sched, batch)  # type: ignore[arg-type]
        elapsed = time.perf_counter() - started
        if i >= warmup:
            total_us.append(elapsed * 1e6)
            sizes.append((len(batch.reqs), len(sched.waiting_queue)))
        driver.batch_started(True, driver.clock())
        # the iteration "ran" as planned: evicted rows wait again, the planned prompts are
        # admitted (whole: the prompts are short), the rows not parked emit a token, finished
        # requests leave and as many new ones of their tier arrive
        evicted = set(directive.evict)
        parked = set(directive.park) | evicted
        for req in batch.reqs:
            if req.rid in evicted:
                req.retraction_count += 1
                sched.waiting_queue.append(req)
        batch.reqs = [req for req in batch.reqs if req.rid not in evicted]
        finished: list[_Req] = []
        for req in batch.reqs:
            if req.rid in parked:
                continue
            req.output_ids.append(2)
            req.kv.kv_allocated_len += 1
            if len(req.output_ids) >= req.output_len:
                req.finished_reason = "length"
                finished.append(req)
        admitted = [req for req in sched.waiting_queue if req.rid in directive.prefill_tokens]
        if admitted:
            chosen = {req.rid for req in admitted}
            sched.waiting_queue = [req for req in sched.waiting_queue if req.rid not in chosen]
            for req in admitted:
                req.output_ids.append(2)  # the prompt's pass emits the first token
                req.kv.kv_allocated_len = len(req.origin_input_ids) + len(req.output_ids)
            batch.reqs += admitted
        driver.note_finished(finished)
        batch.reqs = [req for req in batch.reqs if req.finished_reason is None]
        for req in finished:
            tier = "rt" if req.rid.startswith("rt") else "be"
            sched.waiting_queue.append(_request(rng, next(serial), tier))
    plan_us = [ms * 1000.0 for ms in driver.stats.plan_ms[-iterations:]]
    total_us.sort()
    return {
        "plan_iteration_us_p50": statistics.median(total_us),
        "plan_iteration_us_p90": total_us[int(0.9 * len(total_us))],
        "policy_plan_us_p50": statistics.median(plan_us),
        "running_mean": statistics.fmean(r for r, _ in sizes),
        "waiting_mean": statistics.fmean(w for _, w in sizes),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = {}
    for shape in args.shape or list(SHAPES):
        out = measure(shape, iterations=args.iterations, warmup=args.warmup, seed=args.seed)
        results[shape] = out
        print(
            f"{shape:>9}: plan_iteration p50 {out['plan_iteration_us_p50']:7.0f} µs "
            f"(p90 {out['plan_iteration_us_p90']:7.0f}), of it the policy's plan() "
            f"{out['policy_plan_us_p50']:6.0f} µs; {out['running_mean']:.0f} running and "
            f"{out['waiting_mean']:.0f} waiting on average"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
