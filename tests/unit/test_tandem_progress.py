"""tandem never plans an empty iteration while the engine has work it could run, even when its
latency model says every candidate is far too slow for the budget (a profile measured on a busy
machine: a real engine sat idle with 47 BE requests queued before this held). Hand-built
snapshots; budgets of 1 µs make every chunk "too slow"."""

from __future__ import annotations

from backend.policy.latency import BatchShape, LatencyModel
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.types import ReqState
from tests.unit.tandem_factories import chunks, make_policy, make_request, snapshot

NO_TIME = {
    "latency_budget_s": 1e-6,
    "idle_budget_s": 1e-6,
    "min_chunk_tokens": 64,
    "least_chunk_stretch": 0.0,
}


def _partial(rid: str, tier: str) -> ReqState:
    return make_request(rid, tier=tier, prompt_len=500, running=True, prefilled=128)  # type: ignore[arg-type]


def test_a_partial_be_prompt_gets_its_least_chunk() -> None:
    plan = make_policy(**NO_TIME).plan(snapshot(running=[_partial("be", "be")]))
    assert chunks(plan) == {"be": 64}


def test_a_partial_rt_prompt_alone_gets_its_least_chunk() -> None:
    plan = make_policy(**NO_TIME).plan(snapshot(running=[_partial("rt", "rt")]))
    assert chunks(plan) == {"rt": 64}


def test_an_idle_engine_admits_the_rt_head_before_the_be_head() -> None:
    rt = make_request("rt", prompt_len=500)
    be = make_request("be", tier="be", prompt_len=500)
    policy = make_policy(**NO_TIME)
    assert chunks(policy.plan(snapshot(waiting=[be, rt]))) == {"rt": 64}


def test_an_idle_engine_admits_the_be_head_when_no_rt_waits() -> None:
    be = make_request("be", tier="be", prompt_len=40)  # shorter than the least chunk: all of it
    assert chunks(make_policy(**NO_TIME).plan(snapshot(waiting=[be]))) == {"be": 40}


def test_progress_is_only_the_last_resort() -> None:
    be = make_request("be", tier="be", prompt_len=500)
    plan = make_policy(latency_budget_s=0.04, idle_budget_s=0.04).plan(snapshot(waiting=[be]))
    assert chunks(plan)["be"] > 64  # the budget allows more than the least chunk: it is used


# Deep into a long prompt on an engine whose attention reads the whole prefix on every chunk
# (the CPU engine's torch-native attention: F_p, Σ (prefix + chunk)², dominates): 1 ms a
# iteration, 1 ms per 1K chunk tokens, and 10 ms per (1K tokens)² of F_p.
PREFIX_BOUND = LatencyModel([0.001, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.010])


def _deep_partial(rid: str, tier: str) -> ReqState:
    return make_request(rid, tier=tier, prompt_len=8192, running=True, prefilled=6000)  # type: ignore[arg-type]


def _least_chunk_plan(stretch: float, tier: str) -> tuple[int, float]:
    policy = TandemPolicy(
        PREFIX_BOUND, config=TandemConfig(**{**NO_TIME, "least_chunk_stretch": stretch})
    )
    (chunk,) = policy.plan(snapshot(running=[_deep_partial(tier, tier)])).prefills
    seconds = PREFIX_BOUND.predict(
        BatchShape(
            prefill_tokens=chunk.tokens,
            num_prefill=1,
            prefill_attn=chunk.tokens * (6000 + chunk.tokens),
            prefill_attn_full=(6000 + chunk.tokens) ** 2,
        )
    )
    return chunk.tokens, seconds


def test_deep_in_a_long_prompt_the_least_chunk_grows_within_its_stretch() -> None:
    for tier in ("be", "rt"):
        least, least_s = _least_chunk_plan(0.0, tier)
        grown, grown_s = _least_chunk_plan(0.25, tier)
        assert least == 64
        # the prefix costs 0.36 s whatever the chunk: a chunk several times longer costs
        # at most a quarter more, and the prompt needs several times fewer of them
        assert grown >= 4 * least
        assert grown_s <= 1.25 * least_s + 1e-9
        assert grown_s / grown < 0.3 * least_s / least  # seconds per prompt token


def test_the_stretch_never_shrinks_the_least_chunk_nor_passes_the_prompt() -> None:
    short = make_request("be", tier="be", prompt_len=6040, running=True, prefilled=6000)
    policy = TandemPolicy(
        PREFIX_BOUND, config=TandemConfig(**{**NO_TIME, "least_chunk_stretch": 5.0})
    )
    assert chunks(policy.plan(snapshot(running=[short]))) == {"be": 40}  # the rest, no more
    cheap = make_policy(**{**NO_TIME, "least_chunk_stretch": 1e-9})
    assert chunks(cheap.plan(snapshot(running=[_partial("be", "be")]))) == {"be": 64}


def test_a_turn_after_a_cached_history_is_not_cut_where_its_prefix_is_its_cost() -> None:
    """A conversation's turn: 251 new tokens after 2,190 the prefix cache holds. Every chunk
    of it attends to the whole history, so cut to the budget it pays the history in each
    chunk; within the stretch it runs whole (1 iteration instead of several)."""

    def plan(stretch: float) -> int:
        config = TandemConfig(latency_budget_s=0.05, least_chunk_stretch=stretch)
        turn = make_request("turn", prompt_len=2441)
        turn.prefilled = turn.cached_len = 2190  # waiting, its history in the prefix cache
        return chunks(TandemPolicy(PREFIX_BOUND, config=config).plan(snapshot(waiting=[turn])))[
            "turn"
        ]

    assert plan(0.0) < 251  # the budget alone: cut
    assert plan(0.25) == 251  # whole: (2,441)² costs < 1.25 × (2,206)²
    # where the cost is the chunk's own (no prefix to speak of), the budget still cuts
    fresh = make_request("fresh", prompt_len=4000)
    config = TandemConfig(latency_budget_s=0.05)
    cut = chunks(TandemPolicy(PREFIX_BOUND, config=config).plan(snapshot(waiting=[fresh])))
    assert cut["fresh"] < 4000


def test_an_rt_prompt_whose_least_chunk_exceeds_the_budget_does_not_wait_for_be() -> None:
    """Deep into a long context every chunk costs its prefix, and here even the least chunk
    takes longer than τ: with BE decoding beside it, the RT prompt still runs (before, it
    waited for every BE request to drain)."""
    turn = make_request("turn", prompt_len=2441)
    turn.prefilled = turn.cached_len = 2417  # 24 tokens to compute after 2,417 cached
    be = [
        make_request(f"be{i}", tier="be", prompt_len=300, running=True, generated=5)
        for i in range(8)
    ]
    config = TandemConfig(latency_budget_s=0.02)  # the chunk alone: 1 ms + 60 ms of prefix
    plan = TandemPolicy(PREFIX_BOUND, config=config).plan(snapshot(waiting=[turn], running=be))
    assert chunks(plan) == {"turn": 24}
