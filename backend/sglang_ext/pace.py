"""An engine slower than its own pace, on purpose (``engine.slowdown``).

A policy plans with a latency profile; the engine it runs on is seldom that fast: a busier
host, a slower GPU, a neighbour taking memory bandwidth. tandem's calibration and SLO admission
are there for that, and the way to show they work — and that stock scheduling does not — is to
run the same workload on an engine made K× slower than its own pace, for every policy alike.
A CPU-burning neighbour does it too, but by an amount nobody controls (on two cores one burner
made the engine 7–40× slower, ``bench/results/new_user/``).

This plugin (entry point ``tandem_pace``, loaded by the launcher with ``engine.slowdown`` set,
`patch` on or off) wraps ``Scheduler.run_batch``: each forward pass is timed and followed by a
sleep of (K − 1) × its time, K the schedule's factor at that moment (``common.slowdown``). The
sleep takes no CPU, so nothing else on the host (the gateway, the bench's client) runs any
differently, and the scheduler's iteration — which tandem's policy measures from one
``get_next_batch_to_run`` to the next — takes K × the forward pass plus SGLang's own
scheduling work. On a GPU the pass is timed to its end (a device synchronize), which also takes
away SGLang's overlap of scheduling with the pass.

Second 0 of the schedule is the engine's start, or, with ``engine.slowdown_start_file``, the
moment that file appears (its text a Unix time to count from; else its modification time): the
live bench writes it as its replay starts, so that its idle measurements run at the engine's own
pace. The file is looked for at most every ``START_FILE_POLL_S``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from backend.sglang_ext.seams import RUN_BATCH_SEAM
from common.config import engine_settings_from_env
from common.slowdown import Slowdown, factor_at, format_slowdown

logger = logging.getLogger(__name__)

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
START_FILE_POLL_S = 0.25
"""How often the start file is looked for until it appears, seconds."""


class Stretch:
    """The pause after each forward pass: (K − 1) × its time, K the schedule's factor then."""

    def __init__(
        self,
        schedule: Slowdown,
        start_file: str | None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.schedule = schedule
        self.start_file = start_file
        self.wall_clock = wall_clock
        self.start_unix_s: float | None = None if start_file else wall_clock()
        """Second 0 of the schedule (None: the start file has not appeared yet)."""
        self._looked_at_s = -START_FILE_POLL_S
        self.stretched_s = 0.0
        """Seconds slept so far."""

    def factor_now(self) -> float:
        """The factor in effect now (1 before second 0)."""
        now = self.wall_clock()
        if self.start_unix_s is None:
            if now - self._looked_at_s < START_FILE_POLL_S:
                return 1.0
            self._looked_at_s = now
            self.start_unix_s = _start_of(self.start_file)
            if self.start_unix_s is None:
                return 1.0
            logger.warning(  # when a drill starts is worth the operator's eye
                "tandem: slowdown %s counts from %.3f (%s)",
                format_slowdown(self.schedule),
                self.start_unix_s,
                self.start_file,
            )
        return factor_at(self.schedule, now - self.start_unix_s)

    def pause_s(self, pass_s: float) -> float:
        """How long to sleep after a forward pass of *pass_s* seconds."""
        pause = max(0.0, (self.factor_now() - 1.0) * pass_s)
        self.stretched_s += pause
        return pause


def _start_of(path: str | None) -> float | None:
    """The Unix time the start file gives (its text, else its modification time); None while it
    does not exist."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    try:
        return float(text)
    except ValueError:
        return stat.st_mtime


_stretch: Stretch | None = None


def register() -> None:
    """Entry point for ``sglang.srt.plugins`` (name ``tandem_pace``): wraps the forward pass in
    the process that runs it (SGLang's scheduler process; the others are left alone)."""
    global _stretch
    if SCHEDULER_MODULE not in sys.modules:
        return
    settings = engine_settings_from_env()
    if not settings.slowdown:
        logger.warning("tandem: the pace plugin is loaded without engine.slowdown; it does nothing")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _stretch = Stretch(settings.slowdown, settings.slowdown_start_file)
    HookRegistry.register(RUN_BATCH_SEAM, around_run_batch, HookType.AROUND)
    logger.warning(
        "tandem: engine.slowdown %s: every forward pass stretched to K× its time, from %s "
        "(a drill or a benchmark; pid %d)",
        format_slowdown(settings.slowdown),
        settings.slowdown_start_file or "the engine's start",
        os.getpid(),
    )


def around_run_batch(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.run_batch``, then the pause that makes the pass take K × its time."""
    stretch = _stretch
    if stretch is None:
        return original(sched, *args, **kwargs)
    started = time.perf_counter()
    result = original(sched, *args, **kwargs)
    _synchronize_device()
    pause = stretch.pause_s(time.perf_counter() - started)
    if pause > 0.0:
        time.sleep(pause)
    return result


def _synchronize_device() -> None:
    """Waits for a GPU's queued work (its pass is not over when ``run_batch`` returns); nothing
    on CPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
