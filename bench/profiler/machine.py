"""This machine: what it is, and whether other work is using its CPUs right now.

The profiler times a CPU engine that shares the machine with whatever else runs there; every
busy core stretches the engine's iterations. `QuietGate` holds each probe until the CPUs are
idle (the engine is idle between probes, so any load is someone else's).
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class QuietGate:
    """Holds each probe until this machine's CPUs are idle, for at most `max_wait_s`."""

    max_wait_s: float
    """Longest wait per probe, seconds (0: the gate is off)."""
    threshold: ClassVar[float] = 0.12
    """Busy share of all CPUs (engine idle) above which the machine counts as busy."""
    probes: int = 0
    """Probes that passed the gate."""
    busy_starts: int = 0
    """Probes started on a busy machine because the wait ran out."""
    waited_s: float = 0.0
    """Total time spent waiting, seconds."""

    async def wait(self) -> None:
        """Returns once the CPUs were idle over a quarter second, or after `max_wait_s`."""
        started = time.monotonic()
        self.probes += 1
        while (busy := await cpu_busy_share(0.25)) is not None and busy > self.threshold:
            if time.monotonic() - started > self.max_wait_s:
                self.busy_starts += 1
                break
            await asyncio.sleep(1.0)
        self.waited_s += time.monotonic() - started

    def summary(self) -> str:
        """One phrase for the description."""
        if not self.probes:
            return "no wait for idle CPUs"
        return (
            f"each probe waited for idle CPUs (up to {self.max_wait_s:.0f} s; "
            f"{self.waited_s:.0f} s in all; {self.busy_starts} of {self.probes} started "
            f"busy)"
        )


async def cpu_busy_share(window_s: float = 1.0) -> float | None:
    """Share of all CPUs busy over *window_s* (Linux /proc/stat), None elsewhere."""

    def idle_total() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    try:
        idle0, total0 = idle_total()
        await asyncio.sleep(window_s)
        idle1, total1 = idle_total()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def machine_facts() -> dict[str, Any]:
    """Facts about this machine (the engine's, when the profiler runs beside it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "device": "cpu",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
