"""`tandem batch watch`'s progress line."""

from __future__ import annotations

from tandem.batch import progress_line


def test_progress_line_shows_counts_rate_and_eta() -> None:
    line = progress_line("in_progress", 10, 1, 40, 10, 5.0)
    assert line.startswith("[" + "#" * 8 + "-" * 22 + "]")
    assert "10/40 lines (1 failed)" in line and "2.0/s" in line and "ETA 0:00:15" in line


def test_progress_line_before_any_progress_and_when_done() -> None:
    assert "ETA --:--:--" in progress_line("validating", 0, 0, 0, 0, 0.0)
    assert "done" in progress_line("completed", 5, 0, 5, 5, 2.0)
