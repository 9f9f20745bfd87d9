"""The placement routers (backend/policy/placement.py) on hand-built replica states, and the
gateway's place stage choosing with them (gateway/pipeline/placement.py)."""

from __future__ import annotations

from typing import Any

import pytest

from backend.policy.feasibility import Backlog, SloAsk, SloForecaster
from backend.policy.latency import LatencyModel, load_profile
from backend.policy.placement import (
    CACHE_SHARE_CUT,
    CACHE_SHARE_MIN,
    CACHE_SHARE_STEP,
    ROUTERS,
    LeastLoad,
    PlaceAsk,
    PrefixAware,
    PrefixTracker,
    Replica,
    RoundRobin,
    SloAware,
    make_router,
    prefix_keys,
    token_prefix_keys,
)
from backend.policy.profiles import resolve_profile
from common.config import ConfigError, load_config
from common.wire import EngineLoad
from gateway.engine.load import LoadWatcher
from gateway.pipeline.admission import slo_ask
from gateway.pipeline.placement import EngineHandle, choose_engine, decide
from gateway.pipeline.prepare import build_engine_request
from tests.unit.pipeline_factories import (
    FakeEngine,
    chat_body,
    make_principal,
    make_request,
    replies,
)

KV = 100_000


@pytest.fixture(scope="module")
def forecaster() -> SloForecaster:
    profile = load_profile(resolve_profile("h100-llama8b-analytic"))
    return SloForecaster(LatencyModel.fit(profile.samples))


def load(iteration: int = 1, **fields: Any) -> EngineLoad:
    fields.setdefault("kv_capacity_tokens", KV)
    fields.setdefault("calibration_samples", 100)
    return EngineLoad(iteration=iteration, at_unix_s=0.0, **fields)


def replicas(*loads: EngineLoad | None) -> list[Replica]:
    return [Replica(name=f"r{i}", load=state) for i, state in enumerate(loads)]


def rt_ask(prompt: int = 200, keys: tuple[int, ...] = (), ttft_s: float = 0.4) -> PlaceAsk:
    slo = SloAsk(prompt_tokens=prompt, ttft_target_s=ttft_s, tpot_target_s=0.2)
    return PlaceAsk(tier="rt", prompt_tokens=prompt, prefix_keys=keys, block_tokens=512, slo=slo)


def be_ask(prompt: int = 600, keys: tuple[int, ...] = ()) -> PlaceAsk:
    return PlaceAsk(tier="be", prompt_tokens=prompt, prefix_keys=keys, block_tokens=512)


def test_round_robin_takes_replicas_in_turn() -> None:
    router = RoundRobin()
    pool = replicas(load(), load(), load())
    assert [router.choose(be_ask(), pool).index for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_load_counts_running_and_waiting_tokens_of_both_tiers() -> None:
    router = LeastLoad()
    busy_rt = load(rt_context_tokens=3000, rt_waiting_prompt_tokens=1000)
    busy_be = load(be_context_tokens=2000, be_waiting_prompt_tokens=2500)
    light = load(rt_context_tokens=500, be_waiting_prompt_tokens=500)
    assert router.choose(be_ask(), replicas(busy_rt, busy_be, light)).index == 2


def test_least_load_spreads_a_burst_between_two_reports() -> None:
    """Requests placed since a replica's last report count as its load: a burst arriving
    before the next report does not all land on the replica that looked emptiest."""
    router = LeastLoad()
    pool = replicas(load(), load(be_context_tokens=900))
    chosen = [router.choose(be_ask(prompt=600), pool).index for _ in range(4)]
    assert chosen == [0, 0, 1, 0]
    # a new report of replica 0 (next iteration) replaces what was counted as sent to it
    pool[0] = Replica(name="r0", load=load(iteration=2, be_waiting_prompt_tokens=10_000))
    assert router.choose(be_ask(), pool).index == 1


def test_prefix_router_keeps_a_shared_prefix_on_one_replica() -> None:
    router = PrefixAware()
    pool = replicas(load(), load(), load())
    system = prefix_keys([1, 2, 3])
    first = router.choose(be_ask(prompt=1600, keys=system), pool).index
    # other prompts fill the other replicas; the prefix's requests still go to the first
    for i in range(3):
        router.choose(be_ask(prompt=500, keys=prefix_keys([100 + i])), pool)
    again = [
        router.choose(be_ask(prompt=1800, keys=(*system, hash(i))), pool).index for i in range(3)
    ]
    assert again == [first] * 3


def test_prefix_router_balances_past_the_imbalance_threshold() -> None:
    router = PrefixAware(imbalance_tokens=1000, imbalance_ratio=1.5)
    keys = prefix_keys([7, 8])
    pool = replicas(load(), load())
    assert router.choose(be_ask(prompt=1000, keys=keys), pool).index == 0
    overloaded = replicas(load(iteration=2, be_waiting_prompt_tokens=50_000), load(iteration=2))
    assert router.choose(be_ask(prompt=1000, keys=keys), overloaded).index == 1


def test_prefix_router_needs_the_match_to_cover_the_threshold() -> None:
    router = PrefixAware(cache_threshold=0.5)
    pool = replicas(load(), load(be_context_tokens=100))
    router.choose(be_ask(keys=prefix_keys([1])), pool)  # replica 0 holds block [1]
    pool = replicas(load(iteration=2, be_context_tokens=200), load(iteration=2))
    short_match = prefix_keys([1, 2, 3, 4])  # one block of four: 25 %
    assert router.choose(be_ask(prompt=2048, keys=short_match), pool).index == 1


def test_slo_router_sends_rt_where_the_forecast_has_most_slack(
    forecaster: SloForecaster,
) -> None:
    router = SloAware(forecaster)
    queued = load(num_rt_waiting=6, rt_waiting_prompt_tokens=12_000, num_rt_running=4,
                  rt_context_tokens=2000)  # fmt: skip
    decoding = load(num_rt_running=40, rt_context_tokens=40_000)
    light = load(num_rt_running=4, rt_context_tokens=2000, num_be_running=30,
                 be_context_tokens=30_000)  # fmt: skip
    decision = router.choose(rt_ask(), replicas(queued, decoding, light))
    assert decision.index == 2
    assert decision.forecast is not None and decision.forecast.feasible
    assert not decision.unattainable


def test_slo_router_counts_rt_sent_since_the_report(forecaster: SloForecaster) -> None:
    router = SloAware(forecaster)
    backlog = Backlog(num_requests=8, prompt_tokens=16_000)
    pool = [Replica("r0", load(), backlog), Replica("r1", load(num_rt_running=2,
            rt_context_tokens=600))]  # fmt: skip
    assert router.choose(rt_ask(), pool).index == 1


def test_slo_router_reports_a_request_no_replica_can_serve(forecaster: SloForecaster) -> None:
    router = SloAware(forecaster)
    swamped = [
        load(num_rt_waiting=40, rt_waiting_prompt_tokens=80_000 + 1000 * i) for i in range(3)
    ]
    decision = router.choose(rt_ask(), replicas(*swamped))
    assert decision.unattainable
    assert decision.forecast is not None and decision.forecast.shortfall is not None
    assert decision.forecast.shortfall.target == "ttft"
    assert decision.index == 0  # the closest to meeting it


def test_slo_router_keeps_a_conversation_on_the_replica_holding_its_turns(
    forecaster: SloForecaster,
) -> None:
    router = SloAware(forecaster)
    turn1 = prefix_keys([11, 12])
    pool = replicas(load(), load())
    home = router.choose(rt_ask(prompt=1100, keys=turn1), pool).index
    # the home replica is now busier than the other, yet still meets the contract
    busier = [load(iteration=2, num_rt_running=8, rt_context_tokens=4000), load(iteration=2)]
    if home == 1:
        busier.reverse()
    turn2 = (*turn1, hash(13))
    assert router.choose(rt_ask(prompt=1700, keys=turn2), replicas(*busier)).index == home
    # ...but not when it cannot: the turn moves to where the contract holds
    swamped = [load(iteration=3, num_rt_waiting=30, rt_waiting_prompt_tokens=60_000),
               load(iteration=3)]  # fmt: skip
    if home == 1:
        swamped.reverse()
    turn3 = (*turn2, hash(14))
    decision = router.choose(rt_ask(prompt=2200, keys=turn3), replicas(*swamped))
    assert decision.index == 1 - home and not decision.unattainable


def test_slo_router_does_not_gather_new_conversations_behind_a_shared_system_prompt(
    forecaster: SloForecaster,
) -> None:
    """A prefix every replica holds (a system prompt, a chat template) is no reason to prefer
    one: each new conversation goes where the forecast has most slack, the shared prefix taken
    off every holder's prompt. Before, the first holder kept every new conversation while its
    forecast held (in the simulator, Azure conversations behind one shared block on 8 replicas:
    joint attainment 0.984 where round-robin kept 0.996)."""
    router = SloAware(forecaster)
    system = 7
    idle = replicas(load(), load())
    # warm-up: whichever replica gets the system prompt first is the only one holding it, and
    # a new conversation stays there while the contract holds (it is cached there only)
    first = router.choose(rt_ask(prompt=1100, keys=prefix_keys([system, 100])), idle).index
    again = router.choose(rt_ask(prompt=1100, keys=prefix_keys([system, 101])), idle).index
    assert again == first
    # both hold it now (one conversation went to the other while the first was swamped)
    swamped = [load(iteration=2, num_rt_waiting=30, rt_waiting_prompt_tokens=60_000),
               load(iteration=2)]  # fmt: skip
    if first == 1:
        swamped.reverse()
    moved = router.choose(rt_ask(prompt=1100, keys=prefix_keys([system, 102])), replicas(*swamped))
    assert moved.index == 1 - first
    # the first holder busy but able to meet the contract, the other idle: a new conversation
    # goes to the idle one; a turn of a conversation only the busy one holds stays there
    busy = [load(iteration=3, num_rt_running=12, rt_context_tokens=12_000), load(iteration=3)]
    if first == 1:
        busy.reverse()
    pool = replicas(*busy)
    new = router.choose(rt_ask(prompt=1100, keys=prefix_keys([system, 103])), pool)
    assert new.index == 1 - first and new.forecast is not None and new.forecast.feasible
    turn = prefix_keys([system, 100, 200])
    assert router.choose(rt_ask(prompt=1600, keys=turn), pool).index == first


def test_slo_router_forecasts_an_idle_unverified_replica_at_its_profiles_pace(
    forecaster: SloForecaster,
) -> None:
    """A fresh engine's few slow first iterations are no measure of it: idle and unverified,
    a replica is forecast at its profile's pace, else its busier, calibrated neighbour would
    take every request while nothing could ever correct its own pace."""
    router = SloAware(forecaster)
    warm_up = load(latency_factors=(2.0, 2.0, 2.0), calibration_samples=11)
    serving = load(num_rt_running=2, rt_context_tokens=1000, latency_factors=(1.4, 1.4, 1.4))
    assert router.choose(rt_ask(), replicas(warm_up, serving)).index == 0
    # verified, its pace stands: the faster one gets it
    slow = load(latency_factors=(2.0, 2.0, 2.0), calibration_samples=500)
    assert SloAware(forecaster).choose(rt_ask(), replicas(slow, serving)).index == 1


def test_slo_router_sends_be_to_the_most_leftover_capacity_and_keeps_batch_groups(
    forecaster: SloForecaster,
) -> None:
    router = SloAware(forecaster, imbalance_tokens=5000)
    full = load(kv_used_tokens=90_000)
    half = load(kv_used_tokens=50_000)
    queued = load(kv_used_tokens=20_000, be_waiting_prompt_tokens=60_000)
    group = prefix_keys([21, 22])
    assert router.choose(be_ask(prompt=1200, keys=group), replicas(full, half, queued)).index == 1
    # the group's next line stays although replica 2 now has a little more left
    pool = replicas(load(iteration=2, kv_used_tokens=90_000),
                    load(iteration=2, kv_used_tokens=52_000),
                    load(iteration=2, kv_used_tokens=48_000))  # fmt: skip
    assert router.choose(be_ask(prompt=1200, keys=(*group, 5)), pool).index == 1
    # a line without the prefix goes to the most leftover
    assert router.choose(be_ask(prompt=1200, keys=prefix_keys([99])), pool).index == 2


def test_a_replica_without_a_report_is_placed_on_as_empty(forecaster: SloForecaster) -> None:
    pool = replicas(load(num_rt_waiting=5, rt_waiting_prompt_tokens=20_000), None)
    assert SloAware(forecaster).choose(rt_ask(), pool).index == 1
    assert LeastLoad().choose(be_ask(), pool).index == 1


def test_routers_refuse_an_empty_pool_and_unknown_names(forecaster: SloForecaster) -> None:
    for name in ROUTERS:
        with pytest.raises(ValueError, match="no replica"):
            make_router(name, forecaster).choose(be_ask(), [])
    with pytest.raises(ValueError, match=r"unknown router .fastest.*slo, round-robin"):
        make_router("fastest", forecaster)
    with pytest.raises(ValueError, match="needs an SLO forecaster"):
        make_router("slo")


def test_prefix_tracker_forgets_the_oldest_keys_and_a_lost_replica() -> None:
    tracker = PrefixTracker(max_keys=2)
    tracker.record("a", prefix_keys([1]))
    tracker.record("b", prefix_keys([2, 3]))
    assert tracker.match(prefix_keys([1])) is None  # pushed out
    assert tracker.match(prefix_keys([2, 3, 4])) == ("b", 2)
    tracker.forget("b")
    assert tracker.match(prefix_keys([2])) is None


def test_token_prefix_keys_cover_full_blocks_only() -> None:
    keys = token_prefix_keys(list(range(130)), 64)
    assert len(keys) == 2
    assert keys == token_prefix_keys(list(range(128)), 64)
    assert keys[0] == token_prefix_keys(list(range(64)) + [7] * 64, 64)[0]
    assert keys[1] != token_prefix_keys(list(range(64)) + [7] * 64, 64)[1]


def _handle(name: str, state: EngineLoad | None) -> EngineHandle:
    watcher = LoadWatcher(name)
    if state is not None:
        watcher.update(state)
    return EngineHandle(name=name, client=FakeEngine(replies()), load=watcher)  # type: ignore[arg-type]


def test_place_stage_uses_the_router_on_the_engines_live_state(
    forecaster: SloForecaster,
) -> None:
    principal = make_principal()
    request = make_request(principal, prompt_len=300)
    handles = [
        _handle("http://a", load(num_rt_waiting=9, rt_waiting_prompt_tokens=30_000)),
        _handle("http://b", load()),
    ]
    slo = slo_ask(request, request.meta.arrival_unix_s)
    assert slo is not None
    placement = decide(request, handles, SloAware(forecaster), slo, now_unix_s=0.0)
    assert placement.engine.name == "http://b"
    assert placement.forecast is not None and placement.forecast.feasible
    assert choose_engine(request, handles, LeastLoad(), now_unix_s=0.0).name == "http://b"


def test_place_stage_with_one_engine_is_forced(forecaster: SloForecaster) -> None:
    principal = make_principal()
    request = make_request(principal, prompt_len=300)
    only = [_handle("http://a", load(num_rt_waiting=90, rt_waiting_prompt_tokens=900_000))]
    placement = decide(request, only, SloAware(forecaster))
    assert placement.engine is only[0] and placement.forecast is None
    assert choose_engine(request, only) is only[0]
    assert decide(request, only, LeastLoad()).engine is only[0]


def test_with_one_engine_a_turn_is_forecast_without_the_history_its_cache_holds(
    forecaster: SloForecaster,
) -> None:
    # The SLO admission's forecast of a conversation's next turn counts the new tokens, not
    # the 6,000-token history the engine computed for the turn before (it would refuse the
    # turn on a busy engine for a prompt it will not compute).
    principal = make_principal()
    busy = {"num_rt_running": 16, "rt_context_tokens": 40_000}
    only = [_handle("http://a", load(**busy))]
    router = SloAware(forecaster)

    def forecast(request: Any) -> Any:
        slo = slo_ask(request, request.meta.arrival_unix_s)
        placement = decide(request, only, router, slo, now_unix_s=0.0)
        assert placement.engine is only[0] and placement.forecast is not None
        return placement

    first = forecast(make_request(principal, prompt_len=6000))
    # nothing recorded while it is placed (the admission's path stays short): the record
    # stage remembers the prompt once the engine has computed it
    assert router.tracker.match(first.remember_keys) is None
    router.remember(first.engine.name, first.remember_keys)
    assert only[0].load is not None
    only[0].load.update(load(iteration=2, **busy))  # the turn's report: nothing in flight
    turn = forecast(make_request(principal, prompt_len=6100))  # its history and 100 tokens
    assert turn.cached_tokens == 6000 // 64 * 64
    only[0].load.update(load(iteration=3, **busy))
    fresh_ids = list(range(10_001, 16_101))  # as long, nothing of it computed before
    fresh = forecast(build_engine_request(chat_body(), fresh_ids, 8, principal, "rt"))  # type: ignore[arg-type]
    assert fresh.cached_tokens == 0
    assert turn.forecast.ttft_s < 0.5 * fresh.forecast.ttft_s, (turn, fresh)


def test_the_slo_routers_decision_names_the_cache_it_counted_on(
    forecaster: SloForecaster,
) -> None:
    router = SloAware(forecaster)
    history = prefix_keys([21, 22, 23])
    pool = replicas(load())
    assert router.choose(rt_ask(prompt=1600, keys=history), pool).cached_tokens == 0
    pool = replicas(load(iteration=2))
    turn = router.choose(rt_ask(prompt=1700, keys=(*history, hash(24))), pool)
    assert turn.cached_tokens == 3 * 512  # the blocks it sent before, 512 tokens each


def test_claims_the_engine_did_not_hold_shrink_the_prefix_memory_fast_and_back_slowly(
    forecaster: SloForecaster,
) -> None:
    router = SloAware(forecaster)
    pool = replicas(load(kv_capacity_tokens=51_200))  # 100 blocks of 512
    router.choose(be_ask(prompt=512, keys=prefix_keys([0])), pool)
    assert router.tracker.max_keys == 100
    router.observe_cached(claimed_tokens=2048, engine_cached_tokens=0)  # evicted
    router.observe_cached(claimed_tokens=2048, engine_cached_tokens=512)
    assert router.cache_share == pytest.approx(CACHE_SHARE_CUT**2)
    assert router.tracker.max_keys == int(100 * CACHE_SHARE_CUT**2)
    for _ in range(5):  # held (within its last page and block)
        router.observe_cached(claimed_tokens=2048, engine_cached_tokens=1900)
    assert router.cache_share == pytest.approx(CACHE_SHARE_CUT**2 + 5 * CACHE_SHARE_STEP)
    router.observe_cached(claimed_tokens=0, engine_cached_tokens=0)  # nothing claimed: no news
    assert router.cache_share == pytest.approx(CACHE_SHARE_CUT**2 + 5 * CACHE_SHARE_STEP)
    for _ in range(200):
        router.observe_cached(claimed_tokens=2048, engine_cached_tokens=0)
    assert router.cache_share == pytest.approx(CACHE_SHARE_MIN)  # never forgets everything


def test_slo_router_remembers_no_more_prefixes_than_the_engines_kv_holds(
    forecaster: SloForecaster,
) -> None:
    router = SloAware(forecaster)
    small = replicas(load(kv_capacity_tokens=1024), load(kv_capacity_tokens=1024))  # 4 blocks
    for block in range(6):
        router.choose(be_ask(prompt=512, keys=prefix_keys([block])), small)
    assert router.tracker.match(prefix_keys([1])) is None  # evicted by the engines by now
    assert router.tracker.match(prefix_keys([5])) is not None


def test_config_names_the_router_and_refuses_an_unknown_one() -> None:
    assert load_config(environ={}).gateway.router == "slo"
    config = load_config(environ={"TANDEM_GATEWAY__ROUTER": "prefix"})
    assert make_router(config.gateway.router).name == "prefix"
    with pytest.raises(ConfigError, match="router"):
        load_config(environ={"TANDEM_GATEWAY__ROUTER": "fastest"})


def test_the_simulated_pool_tells_the_router_what_its_replicas_cached(
    forecaster: SloForecaster,
) -> None:
    """As the gateway's record stage does: each request whose placement counted on a cached
    prefix, once run, tells the router how much its replica held (`observe_cached`)."""
    from backend.policy.tandem.policy import TandemPolicy
    from backend.sim.config import SimConfig
    from backend.sim.pool import simulate_pool
    from backend.sim.source import ListSource, SimRequest

    heard: list[tuple[int, int]] = []

    class Listening(SloAware):
        def observe_cached(self, claimed_tokens: int, engine_cached_tokens: int) -> None:
            heard.append((claimed_tokens, engine_cached_tokens))
            super().observe_cached(claimed_tokens, engine_cached_tokens)

    block = 512
    turns = [  # 6 conversations of 3 turns, each turn its history plus 2 blocks, 1 s apart
        SimRequest(
            rid=f"c{c}-t{k}",
            tier="rt",
            arrival_s=0.1 * c + 1.0 * k,
            prompt_len=(k + 1) * 2 * block,
            output_len=8,
            max_new_tokens=8,
            ttft_target_s=2.0,
            tpot_target_s=0.5,
            prefix_hashes=tuple(1000 * c + b for b in range((k + 1) * 2)),
        )
        for c in range(6)
        for k in range(3)
    ]
    router = Listening(forecaster)
    config = SimConfig(kv_capacity_tokens=200_000, prefix_block_tokens=block)
    latency = forecaster.latency
    policies = [TandemPolicy(latency), TandemPolicy(latency)]
    simulate_pool(ListSource(turns), policies, latency, config, router)
    assert heard, "no turn was placed on its cached history"
    # an ample pool keeps every conversation's history: each claim held
    assert all(cached >= 0.9 * claimed for claimed, cached in heard), heard
    assert router.cache_share == 1.0
