"""Killing a gateway in the middle of a batch, at a moment it has lines on the engine.

A gateway runs a batch's lines in waves of `batch.max_inflight`, and a wave's lines (one length
each) finish together: between two waves it has none running for a moment, and a kill that
falls there tests no hand-over at all. `freeze_with_lines_running` stops the process (SIGSTOP:
it commits nothing more and keeps its connections, locks included), reads the lines' states as
committed in SQL, and thaws it to try again when none was running, or when the read could not
tell what is committed (SQLite: the process froze holding the write lock, perhaps in the middle
of a commit that is in the WAL but not yet published, which the restart's recovery would keep);
the caller then SIGKILLs the frozen process, whose running lines are exactly the ones read.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.waiting import wait_until_sync


def freeze_with_lines_running(
    proc: subprocess.Popen[bytes],
    line_counts: Callable[[], tuple[int, int] | None],
    *,
    min_done: int,
    total: int,
    timeout_s: float = 300.0,
) -> int:
    """Freezes *proc* once *min_done* lines have succeeded and some are running, and returns
    how many are running (≥ 1). *line_counts* reads (succeeded, running) from SQL, or None
    when a write of the process is under way and what it will have committed is not known."""

    def frozen() -> int:
        before = line_counts()
        if before is None or before[0] < min_done:
            return 0
        proc.send_signal(signal.SIGSTOP)
        # the signal is delivered asynchronously: read SQL only once every thread has stopped,
        # or a line committed in between is read as running (a CI run saw 3 running, 2 rerun)
        wait_until_sync(lambda: _stopped(proc.pid), 30, what=f"process {proc.pid} stopped")
        counts = line_counts()
        if counts is None:
            proc.send_signal(signal.SIGCONT)
            return 0
        succeeded, running = counts
        assert succeeded < total, "the batch finished before the kill; make it longer"
        if running == 0:
            proc.send_signal(signal.SIGCONT)
        return running

    return wait_until_sync(
        frozen, timeout_s, what=f"{min_done} lines done and others running before the kill"
    )


def _stopped(pid: int) -> bool:
    """Whether every thread of process *pid* is in the stopped state (`T` in /proc)."""
    tasks = list(Path(f"/proc/{pid}/task").iterdir())
    return bool(tasks) and all(
        (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t") for task in tasks
    )
