"""The README user's scenario on the real engine (`tandem serve` with the shipped config.yaml:
patched SGLang on CPU, tandem's policy, here planning with the bundled `cpu-tiny` profile, which
does not match this machine — the calibration has to close the gap): the chat tenant's
streamed chats alone, then beside a Batch API batch, then the batch to its end.

What the user noticed before (issue 15): beside a 50-line batch the chats' TTFT grew ×12–23
and their TPOT ×7–8, and the gateway refused most of them. The bench scenario
(`python -m bench.studies.new_user`, bench/results/new_user/) measures the issue's targets
(×1.5 TTFT, ×1.3 TPOT) on a quiet machine; this test runs a smaller batch on whatever machine CI
gives it, so it asserts bounds a loaded machine still holds (×3, ×1.6), all within one run.
The TTFT bound was ×2.5 until config.yaml gave the engine one torch thread
(`engine.cpu_threads`): the chats alone got faster (11 ms, from 13–14) and beside the batch
stayed at ~20 ms, so the ratio rose (×1.75–2.04 idle, ×1.85–2.01 beside a CPU spinner, once
×2.57 inside the whole suite) while nothing got slower.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.studies.new_user import Options, run_policy

pytestmark = pytest.mark.slow

CHATS = 6
BATCH_LINES = 24
BATCH_MAX_TOKENS = 64


def test_chats_beside_a_batch_come_about_as_fast_as_alone_and_the_batch_completes(
    tmp_path: Path,
) -> None:
    options = Options(
        chats=CHATS,
        chat_max_tokens=16,
        batch_lines=BATCH_LINES,
        batch_max_tokens=BATCH_MAX_TOKENS,
        profile="cpu-tiny",
        # a contract a busy CI machine still meets, so that no chat is refused for the
        # machine's sake: this test is about what the batch does to them
        contract={"ttft_ms": 2000, "tpot_ms": 400},
    )
    result = run_policy("tandem", tmp_path, options)
    alone, beside = result["alone"], result["beside_batch"]
    assert not result["batch_ended_during_chats"], "the batch ended first; make it longer"
    assert alone["served_rt"] == CHATS, alone
    assert beside["served_rt"] == CHATS, beside  # none refused or downgraded for the batch
    assert beside["failed"] == 0
    assert result["alone_after"]["served_rt"] == CHATS, result["alone_after"]
    assert result["ttft_p50_ratio"] <= 3.0, result  # was ×12–23
    assert result["tpot_p50_ratio"] <= 1.6, result  # was ×7–8
    batch = result["batch"]
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}
    assert batch["lines_with_full_output"] == BATCH_LINES
