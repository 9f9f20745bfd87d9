"""How fast tandem's calibrated latency model follows the engine after its pace changes: the
prediction error over a trailing window of iterations, and the seconds it takes to come back
within a band once a change of pace (a CPU burner starting, a scheduled slowdown) has pushed it
out. Used by the new user's study (its burner phase) and by the live bench
(`--engine-slowdown`, each change of the schedule).

A sample is one iteration: ``{"at_unix_s", "measured_s", "predicted_s"}`` (when it ended, its
measured time, what the calibrated model predicted for it; 0 = no prediction)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

ERROR_BAND = 0.2
"""The prediction error counts as back when |predicted ÷ measured − 1| ≤ this."""
ERROR_WINDOW_S = 1.0
"""The error is judged on the median over the iterations of this trailing window, seconds (one
iteration's ratio is noisy on a shared CPU)."""
ONSET_S = 5.0
"""A change of pace shows as the error leaving the band within this many seconds of it (a CPU
burner's did within 1.1–1.8 s in every run of the new user's study, sessions 33–42); a later
excursion is noise of the shared CPU, reported apart (`excursions`), not the change of pace."""


def _windows(
    samples: list[dict[str, float]], window_s: float
) -> Iterator[tuple[float, list[float]]]:
    """(time, predicted ÷ measured of every iteration in the trailing *window_s*) per sample
    with a prediction."""
    good = [s for s in samples if s["predicted_s"] > 0 and s["measured_s"] > 0]
    lo = 0
    for i, s in enumerate(good):
        while good[lo]["at_unix_s"] < s["at_unix_s"] - window_s:
            lo += 1
        yield s["at_unix_s"], [g["predicted_s"] / g["measured_s"] for g in good[lo : i + 1]]


def error_timeline(samples: list[dict[str, float]], window_s: float) -> list[tuple[float, float]]:
    """(time, median |predicted ÷ measured − 1| over the trailing *window_s*): how far a typical
    iteration's prediction is off, in either direction (on an erratic engine this stays high
    however well the model's mean follows it)."""
    return [
        (t, statistics.median(abs(r - 1.0) for r in ratios))
        for t, ratios in _windows(samples, window_s)
    ]


def ratio_timeline(samples: list[dict[str, float]], window_s: float) -> list[tuple[float, float]]:
    """(time, |p50 of predicted ÷ measured − 1| over the trailing *window_s*): the issue's
    "prediction error (ratio predicted/measured, p50 over a window)" — how far the model's
    middle is from the engine's, whatever the spread of single iterations around it."""
    return [(t, abs(statistics.median(ratios) - 1.0)) for t, ratios in _windows(samples, window_s)]


def recovery_s(
    timeline: list[tuple[float, float]],
    start_unix_s: float,
    band: float,
    hold_s: float = 3.0,
    onset_s: float = ONSET_S,
) -> float | None:
    """Seconds from *start_unix_s* until the windowed error, once the disturbance has shown
    (the first point above *band* within *onset_s* of the start), is back within *band* and
    stays within 1.5 × *band* for the next *hold_s* seconds (or to the timeline's end); 0.0
    when it did not leave the band within *onset_s*, None when it never came back. A point
    above the band that first comes later is not the change of pace that started at
    *start_unix_s* (on this shared CPU the error leaves the band for a moment now and then,
    burner or not): `excursions` lists those."""
    after = [(t, e) for t, e in timeline if t >= start_unix_s]
    hit = next(
        (i for i, (t, e) in enumerate(after) if e > band and t <= start_unix_s + onset_s), None
    )
    if hit is None:
        return 0.0
    for i in range(hit, len(after)):
        t, e = after[i]
        if e <= band and all(e2 <= band * 1.5 for t2, e2 in after[i:] if t2 <= t + hold_s):
            return t - start_unix_s
    return None


def excursions(
    timeline: list[tuple[float, float]], from_unix_s: float, band: float
) -> list[dict[str, float]]:
    """The spells after *from_unix_s* in which the windowed error was above *band*: when each
    began (seconds after *from_unix_s*), how long it lasted (to the next point back within
    *band*, or to the timeline's end) and its peak."""
    spells: list[dict[str, float]] = []
    start: float | None = None
    peak = 0.0
    last_t = from_unix_s
    for t, e in timeline:
        if t < from_unix_s:
            continue
        last_t = t
        if e > band:
            if start is None:
                start, peak = t, e
            peak = max(peak, e)
        elif start is not None:
            spells.append(_spell(start, t, peak, from_unix_s))
            start = None
    if start is not None:
        spells.append(_spell(start, last_t, peak, from_unix_s))
    return spells


def _spell(start: float, end: float, peak: float, origin: float) -> dict[str, float]:
    return {
        "at_s": round(start - origin, 3),
        "duration_s": round(end - start, 3),
        "peak_error": round(peak, 4),
    }
