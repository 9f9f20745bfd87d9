"""A live bench run (`bench.live.LiveRun`) of W1 on the CPU profile, made up for the twin's
unit tests: nothing runs on an engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from backend.policy.latency import LatencyModel, load_profile
from backend.policy.profiles import resolve_profile
from bench.live import LiveRun, live_config
from bench.runner import BenchConfig, build
from common.slowdown import Slowdown


def rt_only_live_run(out_dir: Path, slowdown: Slowdown = (), **fields: Any) -> LiveRun:
    """W1's live run (5 s, 2 RT requests a second) with its RT requests alone: with W1's BE
    batches beside them the token times also follow how the queue's dynamics change with the
    pace (fcfs: TPOT ×1.56, TTFT ×0.5 with the bundled profile), not only the iterations'
    times. *slowdown*: `--engine-slowdown`; *fields*: further `LiveRun` fields."""
    config = live_config(
        BenchConfig(
            workload="W1",
            out_dir=out_dir,
            engine="sglang",
            duration_s=5.0,
            engine_slowdown=slowdown,
        )
    )
    profile = load_profile(resolve_profile(config.profile))
    latency = LatencyModel.fit(profile.samples)
    workload, kv = build(config, latency, profile)
    rt_only = dataclasses.replace(
        workload, make_source=lambda rate, _be: workload.make_source(rate, False)
    )
    return LiveRun(
        config=config,
        workload=rt_only,
        profile_name="cpu-tiny",
        kv_capacity_tokens=kv,
        rt_capacity_req_s=None,
        rt_rate_req_s=2.0,
        policy_options={},
        **fields,
    )
