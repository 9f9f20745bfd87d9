"""tandem's fast latency arithmetic equals the latency model (predictions and the inversion)."""

from __future__ import annotations

import random

import pytest

from backend.policy.latency import BatchShape, LatencyModel, load_profile
from backend.policy.profiles import PROFILES_DIR
from backend.policy.tandem.timing import BatchTotals, Timer
from tests.unit.tandem_factories import LATENCY

ANALYTIC = LatencyModel.fit(load_profile(PROFILES_DIR / "h100-llama8b-analytic.json").samples)


def _random_totals(rng: random.Random) -> tuple[BatchTotals, BatchShape]:
    totals = BatchTotals()
    shape = BatchShape()
    for _ in range(rng.randint(0, 3)):
        chunk, prefix = rng.randint(1, 4000), rng.randint(0, 20_000)
        shape = shape.with_prefill(chunk, prefix)
    for _ in range(rng.randint(0, 50)):
        shape = shape.with_decode(rng.randint(10, 8000))
    totals.prefill_tokens, totals.num_prefill = shape.prefill_tokens, shape.num_prefill
    totals.prefill_attn, totals.prefill_attn_full = shape.prefill_attn, shape.prefill_attn_full
    totals.decode_context, totals.num_decode = shape.decode_context, shape.num_decode
    totals.decode_context_sq = shape.decode_context_sq
    return totals, shape


@pytest.mark.parametrize("model", [LATENCY, ANALYTIC], ids=["linear", "analytic-two-piece"])
def test_predictions_and_inversion_match_the_model(model: LatencyModel) -> None:
    rng = random.Random(0)
    timer = Timer(model)
    for _ in range(300):
        totals, shape = _random_totals(rng)
        assert timer.predict(totals) == pytest.approx(model.predict(shape), rel=1e-12, abs=1e-15)
        prefix, cap = rng.randint(0, 30_000), rng.randint(1, 9000)
        limit = model.predict(shape) + rng.uniform(-0.005, 0.2)
        expected = model.max_chunk(shape, limit, prefix=prefix, cap=cap)
        assert timer.max_chunk(totals, limit, prefix=prefix, cap=cap) == expected


def test_the_inverted_chunk_fills_the_budget_exactly() -> None:
    timer = Timer(ANALYTIC)
    totals = BatchTotals()
    chunk = timer.max_chunk(totals, 0.05, prefix=0, cap=100_000)
    assert timer.with_chunk(totals, chunk, 0) <= 0.05 < timer.with_chunk(totals, chunk + 1, 0)


def test_the_batch_predicts_what_the_model_predicts_for_its_shape() -> None:
    from backend.policy.tandem.batch import TandemBatch
    from tests.unit.tandem_factories import make_request, snapshot

    decodes = [
        make_request(f"d{i}", prompt_len=1000 + i, running=True, generated=3) for i in range(5)
    ]
    waiting = make_request("w", prompt_len=3000)
    batch = TandemBatch(snapshot(waiting=[waiting], running=decodes), Timer(ANALYTIC))
    assert batch.add_decodes(decodes[:3])
    assert batch.add_decode(decodes[3]) and batch.add_decode(decodes[4])
    assert batch.add_prefill(waiting, batch.chunk_for(waiting, 0.05))
    assert batch.time_s() == pytest.approx(ANALYTIC.predict(batch.shape()), rel=1e-12)
    assert batch.time_s() <= 0.05
