"""The router capacity study (bench/studies/router_capacity.py): a router's capacity is the
largest rate of the grid up to which every run kept the attainment goal."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.studies.router_capacity import capacity, main


def _row(scale: float, attainment: float | None) -> dict[str, float | None]:
    return {"rate_scale": scale, "rt_joint_attainment": attainment, "rt_goodput_req_s": scale}


def test_the_capacity_is_the_last_rate_before_the_first_miss() -> None:
    rows = [_row(40, 0.995), _row(24, 0.999), _row(32, 0.991), _row(48, 0.97), _row(56, 0.992)]
    best = capacity(rows, 0.99)
    assert best is not None and best["rate_scale"] == 40  # ×56 met again, past a miss: not it


def test_no_capacity_when_the_smallest_rate_misses() -> None:
    assert capacity([_row(24, 0.98), _row(28, 0.999)], 0.99) is None
    assert capacity([_row(24, None)], 0.99) is None


def test_bad_options_are_refused_with_their_name(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    with pytest.raises(SystemExit, match="--scales"):
        main([str(trace), "--scales", "24,x"])
    with pytest.raises(SystemExit, match="--goal"):
        main([str(trace), "--goal", "1.5"])
    with pytest.raises(SystemExit, match="no such file"):
        main([str(tmp_path / "missing.jsonl")])
