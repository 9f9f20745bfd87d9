"""The refusal study's arithmetic (bench/studies/refusals.py) on a hand-built run: each shed RT
request against the admitted ones that arrived beside it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.studies.refusals import main, read_run, summarise


def row(rid: str, arrival_s: float, ttft_s: float | None, **fields: Any) -> dict[str, Any]:
    """One request of a live bench's requests.json: RT with a 1.5 s TTFT target, admitted and
    its first token *ttft_s* after arrival (None: shed, or never came)."""
    out: dict[str, Any] = {
        "rid": rid,
        "tier": "rt",
        "arrival_s": arrival_s,
        "first_token_s": None if ttft_s is None else arrival_s + ttft_s,
        "ttft_target_s": 1.5,
        "admission": "admitted",
    }
    out.update(fields)
    return out


RUN = [
    row("a", 0.0, 1.2),
    row("b", 0.5, 1.4),
    row("shed-1", 0.6, None, admission="shed"),  # neighbours a, b, c: all in time, worst 1.4
    row("c", 1.4, 0.9),
    row("d", 5.0, 1.8),  # admitted and late
    row("shed-2", 5.5, None, admission="shed"),  # neighbour d: late
    row("shed-3", 20.0, None, admission="shed"),  # nobody beside it
    row("be", 0.2, 3.0, tier="be", ttft_target_s=None),  # BE: not an RT request
    row("lost", 9.0, None),  # admitted, no first token: late
]


def test_each_shed_request_is_judged_by_its_admitted_neighbours() -> None:
    got = summarise("tandem", RUN, window_s=1.0)
    assert (got.rt_offered, got.rt_shed, got.rt_admitted_late) == (8, 3, 2)
    assert (got.shed_with_neighbours, got.shed_neighbours_all_met) == (2, 1)
    assert got.neighbour_worst_ttft_max_s == pytest.approx(1.8)
    assert got.neighbour_worst_ttft_p50_s == pytest.approx((1.4 + 1.8) / 2)
    assert got.ttft_target_s == 1.5
    wider = summarise("tandem", RUN, window_s=20.0)  # every admitted RT request is a neighbour
    assert (wider.shed_with_neighbours, wider.shed_neighbours_all_met) == (3, 0)
    none_shed = summarise("priority", [r for r in RUN if r["admission"] != "shed"], 1.0)
    assert none_shed.rt_shed == 0 and none_shed.neighbour_worst_ttft_p50_s is None


def test_a_live_run_is_read_per_policy_and_a_wrong_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for policy in ("tandem", "priority"):
        (tmp_path / policy).mkdir()
        rows = RUN if policy == "tandem" else [r for r in RUN if r["admission"] != "shed"]
        (tmp_path / policy / "requests.json").write_text(json.dumps({"requests": rows}))
    assert [s.policy for s in read_run(tmp_path, 1.0)] == ["priority", "tandem"]
    out = tmp_path / "summary.json"
    assert main([str(tmp_path), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| tandem | 8 | 3 | 2 | 1 of 2 | 1.60 | 1.80 |" in table
    assert [s["policy"] for s in json.loads(out.read_text())] == ["priority", "tandem"]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "priority")])  # a policy's own directory, not the live one
    assert "no <policy>/requests.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--window-s", "0"])
    assert "--window-s must be > 0" in capsys.readouterr().err
