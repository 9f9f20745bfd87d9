"""Admission is a sequence of checks, each returning Admitted or Refused: the first refusal wins
and gives back what the earlier checks hold; a check may change the request's terms (the seam the
SLO-feasibility downgrade will use)."""

from __future__ import annotations

import msgspec
import pytest

from common.config import Config, EngineConfig
from gateway.metrics import GatewayMetrics
from gateway.pipeline.admission import (
    Admitted,
    QuotaCheck,
    QuotaHold,
    admit_through,
    build_forecaster,
)
from gateway.pipeline.outcome import Refused
from gateway.quotas.limiter import QuotaLimiter
from gateway.store.types import Quota
from tests.unit.pipeline_factories import make_principal, make_request, make_tenant


class Hold:
    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, used_tokens: int) -> None:
        self.released.append(used_tokens)


def candidate(quota: Quota | None = None, origin: str = "api") -> Admitted:
    tenant = make_tenant("rt", quota=quota)
    return Admitted(tenant=tenant, origin=origin, request=make_request(make_principal(tenant)))  # type: ignore[arg-type]


REFUSE = Refused(kind="rate_limited", http_status=429, message="no", retryable=True)


def test_every_check_passing_admits_with_all_their_holds() -> None:
    first, second = Hold(), Hold()
    outcome = admit_through([lambda a: a.holding(first), lambda a: a.holding(second)], candidate())
    assert isinstance(outcome, Admitted) and outcome.holds == (first, second)


def test_the_first_refusal_wins_and_releases_the_earlier_holds() -> None:
    held, later = Hold(), list[Admitted]()

    def never(a: Admitted) -> Admitted:
        later.append(a)
        return a

    outcome = admit_through([lambda a: a.holding(held), lambda a: REFUSE, never], candidate())
    assert outcome is REFUSE
    assert held.released == [0]  # nothing ran: nothing used
    assert later == []  # checks after a refusal do not run


def test_a_check_may_change_the_terms() -> None:
    def downgrade(a: Admitted) -> Admitted:
        return msgspec.structs.replace(a, request=make_request(make_principal(a.tenant), tier="be"))

    outcome = admit_through([downgrade], candidate())
    assert isinstance(outcome, Admitted) and outcome.request.meta.tier == "be"


def test_quota_check_holds_a_ticket_or_refuses_with_429_and_retry_after() -> None:
    limiter, metrics = QuotaLimiter("gw_test"), GatewayMetrics()
    check = QuotaCheck(limiter, metrics)
    quota = Quota(requests_per_min=1)
    admitted = check(candidate(quota))
    assert isinstance(admitted, Admitted) and isinstance(admitted.holds[0], QuotaHold)
    refused = check(candidate(quota))
    assert isinstance(refused, Refused)
    assert (refused.kind, refused.http_status, refused.code) == (
        "rate_limited",
        429,
        "requests_per_min_exceeded",
    )
    assert refused.retryable and refused.retry_after_s is not None
    assert refused.api_error().headers == {"Retry-After": str(refused.retry_after_s)}
    assert b'tandem_quota_rejections_total{limit="requests_per_min"' in metrics.render()


def test_batch_lines_are_not_held_to_the_per_minute_limits() -> None:
    check = QuotaCheck(QuotaLimiter("gw_test"), GatewayMetrics())
    quota = Quota(requests_per_min=1)
    outcomes = [check(candidate(quota, origin="batch")) for _ in range(3)]
    assert all(isinstance(o, Admitted) for o in outcomes)


def test_the_gateway_forecasts_with_the_engine_policys_options() -> None:
    """The SLO forecast chunks and keeps headroom as the engine's tandem policy is configured
    (the simulator's front door does the same), not with the forecaster's defaults."""
    engine = EngineConfig(
        kind="sglang",
        policy="tandem",
        profile="cpu-tiny",
        policy_options={
            "latency_budget_s": 0.2,
            "slo_headroom": 0.5,
            "slo_pace_averaging": False,
        },
    )
    forecaster = build_forecaster(Config(engine=engine))
    assert forecaster.iteration_budget_s == 0.2
    assert forecaster.headroom == 0.5
    assert not forecaster.pace_averaging
    assert forecaster.budget_pace_max == 4.0  # tandem's default: L follows the engine's pace
    stock = build_forecaster(Config(engine=msgspec.structs.replace(engine, policy="fcfs")))
    assert stock.iteration_budget_s == 0.05  # the forecaster's own defaults for another policy
    assert stock.pace_averaging
    bad = msgspec.structs.replace(engine, policy_options={"latency_budget_s": -1.0})
    with pytest.raises(ValueError, match=r"engine\.policy_options: latency_budget_s"):
        build_forecaster(Config(engine=bad))
