"""The slot-wait study (`python -m bench.studies.slot_wait`) runs end to end on small streams
and writes what it printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies import slot_wait


def test_the_study_writes_a_row_per_quantile_feedback_and_length_law(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert slot_wait.main(["--seeds", "1", "--requests", "40", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    rows = result["rows"]
    assert {(r["lengths"], r["slo_slot_free_quantile"], r["ttft_feedback"]) for r in rows} == {
        (lengths, q, feedback)
        for lengths in ("uniform", "lognormal")
        for feedback, quantiles in (
            (False, slot_wait.QUANTILES),
            (True, slot_wait.FEEDBACK_QUANTILES),
        )
        for q in quantiles
    }
    for row in rows:
        assert row["offered"] == 40 * len(slot_wait.RATES_REQ_S)
        assert 0 < row["admitted"] <= row["offered"]
        assert 0 <= row["admitted_late"] <= row["admitted"]
    assert set(result["report_cost_us_p50"]) == {"8", "64", "256"}
    assert "late/admitted" in capsys.readouterr().out


def test_the_study_refuses_an_empty_run() -> None:
    with pytest.raises(SystemExit):
        slot_wait.main(["--seeds", "0"])
