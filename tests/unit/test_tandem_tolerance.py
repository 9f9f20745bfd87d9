"""tandem under a mean-TTFT tolerance (presets.TOLERANCE_RULES) on hand-built snapshots
(LATENCY: 10 ms + 20 ms per 1K prefill tokens + 1 ms per 1K decode context): no BE in an
iteration that emits RT first tokens, RT prompts at the rt-only engine's speed, the preset."""

from __future__ import annotations

import pytest

from backend.policy.registry import make_policy as registry_policy
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.presets import TOL5_LATENCY_BUDGET_S, TOLERANCE_RULES
from tests.unit.tandem_factories import LATENCY, chunks, make_policy, make_request, snapshot


def test_be_stays_out_of_an_iteration_that_emits_a_first_token() -> None:
    rt = make_request("rt", prompt_len=500, ttft_target_s=5.0)  # finishes here: 10 + 10 ms
    be = make_request("be", tier="be", prompt_len=5000)
    common = {"latency_budget_s": 0.04, "be_frac_init": 1.0, "be_min_share": 0.05}
    assert chunks(make_policy(**common).plan(snapshot(waiting=[rt, be]))) == {"rt": 500, "be": 1000}
    plan = make_policy(**common, first_token_be_frac=0.0).plan(snapshot(waiting=[rt, be]))
    assert chunks(plan) == {"rt": 500, "be": 100}  # only the floor: 5 % of L = 2 ms
    half = make_policy(**common, first_token_be_frac=0.5).plan(snapshot(waiting=[rt, be]))
    assert chunks(half)["be"] == 500


def test_be_fills_as_usual_when_the_rt_prompt_does_not_finish() -> None:
    rt = make_request("rt", prompt_len=5000, ttft_target_s=5.0)  # cut at τ: no first token
    be = make_request("be", tier="be", prompt_len=5000)
    plan = make_policy(latency_budget_s=0.04, be_frac_init=1.0, first_token_be_frac=0.0).plan(
        snapshot(waiting=[rt, be])
    )
    # RT fills τ; BE gets its floor as always: 3 % of L = 1.2 ms, 60 prompt tokens
    assert chunks(plan) == {"rt": 1500, "be": 60}
    decoding = [make_request(f"d{i}", prompt_len=999, running=True, generated=3) for i in range(5)]
    plan = make_policy(latency_budget_s=0.04, be_frac_init=1.0, first_token_be_frac=0.0).plan(
        snapshot(waiting=[be], running=decoding)
    )
    assert chunks(plan)["be"] == pytest.approx(1250, abs=1)  # decodes only: BE fills τ


def test_rt_prompts_get_the_floor_in_one_iteration_past_l() -> None:
    # L = 20 ms holds 500 prompt tokens; the floor of 2048 RT tokens (5 decodes + 2043 of
    # prompt) stretches the iteration for the prompt as the rt-only engine would
    decoding = [
        make_request(f"d{i}", prompt_len=99, running=True, generated=3, tpot_target_s=1.0)
        for i in range(5)
    ]
    prompt = make_request("p", prompt_len=3000, ttft_target_s=5.0)
    plain = make_policy(latency_budget_s=0.02).plan(snapshot(waiting=[prompt], running=decoding))
    assert chunks(plain)["p"] < 500
    plan = make_policy(latency_budget_s=0.02, rt_prefill_floor_tokens=2048).plan(
        snapshot(waiting=[prompt], running=decoding)
    )
    assert chunks(plan) == {"p": 2043}


def test_the_floor_never_breaks_an_rt_decode_deadline() -> None:
    # the decode is due in 40 ms: τ may rise to (1 − ε)·40 = 36 ms, not to the floor's 51 ms
    decoding = make_request("d", prompt_len=99, running=True, generated=3, tpot_target_s=0.04)
    prompt = make_request("p", prompt_len=3000, ttft_target_s=5.0)
    plan = make_policy(latency_budget_s=0.02, rt_prefill_floor_tokens=2048, eps_init=0.1).plan(
        snapshot(waiting=[prompt], running=[decoding])
    )
    assert plan.predicted_s is not None and plan.predicted_s <= 0.036 + 1e-9
    assert 1200 < chunks(plan)["p"] < 1300


def test_a_prompt_is_scheduled_under_the_floor_even_when_decodes_fill_l() -> None:
    # 30 decodes at 10K context: 10 + 300 ms ≫ L; without the floor the prompt waits
    decoding = [
        make_request(f"d{i}", prompt_len=9999, running=True, generated=1, tpot_target_s=5.0)
        for i in range(30)
    ]
    prompt = make_request("p", prompt_len=100, ttft_target_s=5.0)
    assert "p" not in chunks(
        make_policy(latency_budget_s=0.02).plan(
            snapshot(waiting=[prompt], running=decoding, kv_capacity=1_000_000)
        )
    )
    plan = make_policy(latency_budget_s=0.02, rt_prefill_floor_tokens=2048).plan(
        snapshot(waiting=[prompt], running=decoding, kv_capacity=1_000_000)
    )
    assert chunks(plan) == {"p": 100}


def test_the_tolerance_preset_and_its_validation() -> None:
    policy = registry_policy("tandem-tol5", LATENCY)
    assert policy.name == "tandem-tol5"
    cfg = policy.config  # type: ignore[attr-defined]
    assert cfg.latency_budget_s == TOL5_LATENCY_BUDGET_S
    assert {k: getattr(cfg, k) for k in TOLERANCE_RULES} == TOLERANCE_RULES
    probe = registry_policy("tandem-tol5", LATENCY, latency_budget_s=0.02)
    assert probe.config.latency_budget_s == 0.02  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="first_token_be_frac"):
        TandemConfig(first_token_be_frac=1.5)
    with pytest.raises(ValueError, match="rt_prefill_floor_tokens"):
        TandemConfig(rt_prefill_floor_tokens=-1)
