"""`split_mixed`: where the latency model says the decodes and the prompts of an iteration cost
clearly more together than apart (SGLang's torch-native CPU backend recomputes every decode in a
batch with a prompt), the prompts run in an iteration of their own, the decodes sitting it out
within their TPOT deadlines, and the decodes in the next one, with no prompt."""

from __future__ import annotations

from backend.policy.latency import BatchShape, LatencyModel
from backend.policy.tandem.config import TandemConfig
from backend.policy.tandem.policy import TandemPolicy
from backend.policy.types import Plan
from tests.unit.tandem_factories import LATENCY, NOW, chunks, make_request, snapshot

MIXED_COST = LatencyModel([0.010, 0.020, 0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.005])
"""LATENCY plus 5 ms per (1K tokens)² of full-square attention: 20 decodes at 1K context cost
100 ms more beside a prompt than alone."""

OPTIONS = {"latency_budget_s": 0.04, "split_mixed": True}


def policy(latency: LatencyModel = MIXED_COST, **options: object) -> TandemPolicy:
    return TandemPolicy(latency, config=TandemConfig(**{**OPTIONS, **options}))  # type: ignore[arg-type]


def decoding(count: int = 20, *, last_token_s: float = NOW, tpot_s: float = 0.5) -> list:
    return [
        make_request(
            f"d{i}",
            prompt_len=999,
            running=True,
            generated=1,
            tpot_target_s=tpot_s,
            last_token_s=last_token_s,
        )
        for i in range(count)
    ]


def kinds(plan: Plan) -> tuple[int, int]:
    """(decodes, prompt chunks) of a plan."""
    return len(plan.decodes), len(plan.prefills)


def test_prompts_run_alone_then_the_decodes_alone() -> None:
    running = decoding()
    prompt = make_request("p", prompt_len=200, ttft_target_s=2.0)
    split = policy()
    first = split.plan(snapshot(waiting=[prompt], running=running))
    assert kinds(first) == (0, 1) and chunks(first) == {"p": 200}  # 10 + 4 ms, not 10 + 4 + 100
    # the decodes' turn: a prompt that came meanwhile waits for the next iteration
    late = make_request("q", prompt_len=200, ttft_target_s=2.0, arrival_s=NOW)
    second = split.plan(snapshot(waiting=[late], running=running, now_s=NOW + 0.02))
    assert kinds(second) == (20, 0)
    third = split.plan(snapshot(waiting=[late], running=running, now_s=NOW + 0.06))
    assert kinds(third) == (0, 1)  # and so on, in turn
    # without the option: stall-free mixed batches, as ever
    mixed = policy(split_mixed=False).plan(snapshot(waiting=[prompt], running=running))
    assert kinds(mixed) == (20, 1)


def test_no_split_where_the_model_gives_it_nothing() -> None:
    # a GPU-style model: the decodes cost the same beside a prompt; apart pays the fixed
    # per-iteration cost twice
    plan = policy(LATENCY).plan(snapshot(waiting=[make_request("p")], running=decoding()))
    assert kinds(plan) == (20, 1)


def test_a_split_keeps_the_decodes_on_time_with_a_smaller_chunk() -> None:
    # tokens due in 45 ms: the whole prompt's iteration and then the decodes' (14 + 30 ms)
    # would miss, so the prompt's iteration gets what the decodes leave (about 10 ms: its fixed
    # cost and a few dozen tokens) — not none: beside the decodes a chunk costs 100 ms more,
    # and an RT prompt would wait for as long as the decodes run
    running = decoding(tpot_s=0.06, last_token_s=NOW - 0.015)
    split = policy()
    plan = split.plan(snapshot(waiting=[make_request("p", prompt_len=200)], running=running))
    assert kinds(plan) == (0, 1) and 0 < chunks(plan)["p"] < 200
    assert plan.predicted_s is not None
    decodes = BatchShape(num_decode=20, decode_context=20_000, decode_context_sq=20 * 1000.0**2)
    assert plan.predicted_s + MIXED_COST.predict(decodes) <= 0.045


def test_no_split_where_the_decodes_leave_no_room() -> None:
    # tokens due in 32 ms, the decodes alone take 30: no prompt iteration fits before them
    running = decoding(tpot_s=0.06, last_token_s=NOW - 0.028)
    plan = policy().plan(snapshot(waiting=[make_request("p", prompt_len=200)], running=running))
    assert len(plan.decodes) == 20


def test_an_overdue_prompt_runs_even_where_the_decodes_leave_no_room() -> None:
    # tokens due in 32 ms, the decodes alone take 30 (as above), but this prompt has waited
    # four TTFT targets past its deadline (`rt_late_bound_frac` 1): it gets an iteration of its
    # own, of up to one TPOT (60 ms) — the decodes' next token comes that much later, once
    running = decoding(tpot_s=0.06, last_token_s=NOW - 0.028)
    overdue = make_request("p", prompt_len=200, ttft_target_s=0.2, arrival_s=NOW - 1.0)
    split = policy()
    plan = split.plan(snapshot(waiting=[overdue], running=running))
    assert kinds(plan) == (0, 1) and chunks(plan)["p"] == 200
    assert plan.predicted_s is not None and plan.predicted_s <= 0.06
    # the decodes' turn comes next
    after = split.plan(snapshot(waiting=[], running=running, now_s=NOW + 0.02))
    assert kinds(after) == (20, 0)
    # without the bound, it waits for the decodes to leave room, as before
    patient = policy(rt_late_bound_frac=None)
    assert kinds(patient.plan(snapshot(waiting=[overdue], running=running))) == (20, 0)


def test_be_prompts_ride_in_the_rt_prompts_iteration_but_get_none_of_their_own() -> None:
    typical = make_request("rt", prompt_len=200, ttft_target_s=2.0)
    be = make_request("be", tier="be", prompt_len=5000)
    split = policy(rt_stretch=0.5, be_min_share=0.0, be_frac_init=1.0)
    # the RT prompt's iteration (14 ms) with the decodes' (30 ms) held back: BE may add half of
    # the pair's RT work, 22 ms, of its own prompt (20 ms per 1K tokens and its own square)
    first = split.plan(snapshot(waiting=[typical, be], running=decoding()))
    assert kinds(first) == (0, 2) and chunks(first)["rt"] == 200
    assert 850 <= chunks(first)["be"] <= 1100
    # held-back BE decodes are no RT work: beside a batch and one RT stream, BE adds half of the
    # RT prompt's 14 ms and the stream's decode (11 ms alone), not of the batch's decodes
    batch = [
        make_request(f"b{i}", tier="be", prompt_len=999, running=True, generated=1)
        for i in range(19)
    ]
    beside_batch = policy(rt_stretch=0.5, be_min_share=0.0, be_frac_init=1.0)
    first = beside_batch.plan(snapshot(waiting=[typical, be], running=batch + decoding(1)))
    assert kinds(first) == (0, 2) and 500 <= chunks(first)["be"] <= 620
    # with BE decodes alone nothing is held back for them: the prompt runs beside them, as ever
    only_be = policy(rt_stretch=0.5, be_min_share=0.0, be_frac_init=1.0)
    assert only_be.plan(snapshot(waiting=[typical], running=batch)).prefills
    # BE's prompt alone beside running decodes: the decodes run, BE waits its turn
    alone = policy(rt_stretch=0.5, be_min_share=0.0, be_frac_init=1.0)
    assert len(alone.plan(snapshot(waiting=[be], running=decoding())).decodes) == 20
