"""What the gateway's admission costs per request (issue 15, item 3: p50 ≤ 50 µs): the quota
check and the SLO check (forecast from the engine's live state), run by `admit_through` exactly
as the admit stage runs them, on a hand-built engine state.

Scenarios: an idle engine (every request admitted as RT, so each one also joins the watcher's
backlog, drained as a new engine state arrives every `--state-every` requests, as the long-poll
delivers one per iteration), a swamped engine with a tenant that rejects (every request shed:
the 429 is built) and one that downgrades (every request rebuilt for BE). The quota has every
limit set, so its token buckets and concurrency count all run. Timed: `admit_through` alone; the
record stage's release of the holds is outside the timed region.

    python -m bench.studies.admission_cost                       # 20,000 requests per scenario
    python -m bench.studies.admission_cost --requests 5000 --out bench/results/admission_cost
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from backend.policy.feasibility import SloAsk, SloForecaster
from backend.policy.latency import LatencyModel, load_profile
from backend.policy.placement import make_router
from backend.policy.profiles import resolve_profile
from common.wire import EngineLoad, TenantLoad
from gateway.api.schemas import ChatCompletionRequest
from gateway.auth import Principal
from gateway.engine.load import LoadWatcher
from gateway.metrics import GatewayMetrics
from gateway.pipeline.admission import (
    Admitted,
    QuotaCheck,
    SloCheck,
    admit_through,
    release_holds,
)
from gateway.pipeline.outcome import Refused
from gateway.pipeline.placement import EngineHandle, Placement, decide
from gateway.pipeline.prepare import EngineRequest, build_engine_request
from gateway.quotas.limiter import QuotaLimiter
from gateway.store.types import Quota, Slo, Tenant

PROFILE = "h100-llama8b-analytic"
PROMPT_TOKENS = 512
IDLE = EngineLoad(
    iteration=1,
    at_unix_s=0.0,
    iteration_s=0.01,
    num_rt_running=4,
    rt_context_tokens=4_000,
    kv_used_tokens=4_000,
    kv_capacity_tokens=400_000,
    # the RT work split by tenant, as engines report it: the forecast is per tenant
    rt_by_tenant=(
        TenantLoad(tenant_id="ten_other", num_running=2, fair_counter=1_000_000.0),
        TenantLoad(tenant_id="ten_reject", num_running=2, fair_counter=1_000_500.0),
    ),
)


def swamped(asking_tenant_id: str) -> EngineLoad:
    """40K RT prompt tokens queued, half of them *asking_tenant_id*'s own (with equal weights
    all of the queue is ahead of its request), its fair-share counter 2K tokens above the
    other's and its decodes beyond its share (the forecast's counter gap and drift at work)."""
    return EngineLoad(
        iteration=1,
        at_unix_s=0.0,
        iteration_s=0.05,
        num_rt_waiting=20,
        rt_waiting_prompt_tokens=40_000,
        num_rt_running=30,
        rt_context_tokens=30_000,
        rt_by_tenant=tuple(
            TenantLoad(
                tenant_id=t,
                num_waiting=10,
                waiting_prompt_tokens=20_000,
                num_running=18 if t == asking_tenant_id else 12,
                fair_counter=1_002_000.0 if t == asking_tenant_id else 1_000_000.0,
            )
            for t in ("ten_other", asking_tenant_id)
        ),
    )


def _tenant(on_unattainable: str) -> Tenant:
    now = datetime.now(UTC)
    return Tenant(
        id=f"ten_{on_unattainable}",
        name=on_unattainable,
        tier="rt",
        slo=Slo(
            ttft_target_ms=300, tpot_target_ms=50, deadline_s=60, on_unattainable=on_unattainable
        ),  # type: ignore[arg-type]
        quota=Quota(
            requests_per_min=10**9,
            tokens_per_min=10**12,
            max_concurrent=10**6,
            monthly_tokens=10**15,
        ),
        created_at=now,
        updated_at=now,
    )


def _candidate(tenant: Tenant, seq: int) -> Admitted:
    """Request *seq* of *tenant* as prepare leaves it, arriving now (its first token its own:
    no prompt shares a prefix with another's, so each is forecast whole)."""
    principal = Principal(tenant=tenant, key_id="key_1", key_prefix="p")
    request = build_engine_request(_BODY, [100_000 + seq, *_PROMPT_IDS[1:]], 128, principal, "rt")
    return Admitted(tenant=tenant, origin="api", request=request)


_BODY = msgspec.convert(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest
)
_PROMPT_IDS = list(range(1, PROMPT_TOKENS + 1))


def run_scenario(
    name: str,
    load: EngineLoad,
    on_unattainable: str,
    requests: int,
    state_every: int,
    forecaster: SloForecaster,
) -> dict[str, Any]:
    """Times `admit_through` for *requests* requests; p50/p99/mean in µs and the outcomes."""
    metrics, watcher = GatewayMetrics(), LoadWatcher("bench")
    # the gateway's place stage on its one engine, with config.yaml's router (slo): it forecasts
    # the request with the prefix the engine's cache holds taken off its prompt
    engine = EngineHandle(name="bench", client=None, load=watcher)  # type: ignore[arg-type]
    router = make_router("slo", forecaster)

    def place(request: EngineRequest, slo: SloAsk, now_unix_s: float) -> Placement:
        return decide(request, [engine], router, slo, now_unix_s)

    checks = (QuotaCheck(QuotaLimiter("bench"), metrics), SloCheck(forecaster, place, metrics))
    tenant = _tenant(on_unattainable)
    samples_us: list[float] = []
    outcomes: dict[str, int] = {}
    for i in range(requests):
        candidate = _candidate(tenant, i)
        if i % state_every == 0:  # the engine's next iteration reports what it took in
            # each iteration the running RT decodes' contexts grow by one token each
            watcher.latest = msgspec.structs.replace(
                load,
                iteration=i,
                at_unix_s=time.time(),
                rt_context_tokens=load.rt_context_tokens + i * load.num_rt_running,
            )
        start = time.perf_counter_ns()
        outcome = admit_through(checks, candidate)
        samples_us.append((time.perf_counter_ns() - start) / 1000.0)
        if isinstance(outcome, Refused):
            key = outcome.code or outcome.kind
        else:
            key = outcome.slo.outcome if outcome.slo is not None else "none"
            release_holds(outcome.holds, used_tokens=PROMPT_TOKENS + 128)
        outcomes[key] = outcomes.get(key, 0) + 1
    warm = samples_us[min(500, len(samples_us) // 10) :]  # first calls pay for caches
    quantiles = statistics.quantiles(warm, n=100)
    return {
        "scenario": name,
        "requests": len(warm),
        "p50_us": round(statistics.median(warm), 2),
        "p99_us": round(quantiles[98], 2),
        "mean_us": round(statistics.fmean(warm), 2),
        "outcomes": outcomes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument(
        "--state-every",
        type=int,
        default=8,
        help="requests between two engine states (one per iteration)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for result.json and README.md (default: print only)",
    )
    args = parser.parse_args()
    profile = load_profile(resolve_profile(PROFILE))
    forecaster = SloForecaster(LatencyModel.fit(profile.samples))
    worst = "idle engine, a new engine state for every request (nothing shared)"
    results = [
        run_scenario(
            "idle engine, admitted as RT",
            IDLE,
            "reject",
            args.requests,
            args.state_every,
            forecaster,
        ),
        run_scenario(
            "swamped engine, shed (reject)",
            swamped("ten_reject"),
            "reject",
            args.requests,
            args.state_every,
            forecaster,
        ),
        run_scenario(
            "swamped engine, downgraded to BE",
            swamped("ten_downgrade"),
            "downgrade",
            args.requests,
            args.state_every,
            forecaster,
        ),
        run_scenario(worst, IDLE, "reject", args.requests, 1, forecaster),
    ]
    machine = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}"
    report = {
        "profile": PROFILE,
        "prompt_tokens": PROMPT_TOKENS,
        "machine": machine,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(report, indent=2) + "\n")
        lines = [
            "# Admission cost per request (quota + SLO check)",
            "",
            "`python -m bench.studies.admission_cost --out bench/results/admission_cost` on "
            f"{machine} (a shared 2-core box; other jobs were running). `admit_through` with the "
            f"quota and SLO checks, profile `{PROFILE}`, {PROMPT_TOKENS}-token prompts. "
            "Target: p50 ≤ 50 µs.",
            "",
            "| scenario | requests | p50 µs | p99 µs | mean µs | outcomes |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for r in results:
            outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))
            lines.append(
                f"| {r['scenario']} | {r['requests']} | {r['p50_us']} | "
                f"{r['p99_us']} | {r['mean_us']} | {outcomes} |"
            )
        (args.out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
