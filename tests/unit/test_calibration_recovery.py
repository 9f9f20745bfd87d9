"""How long the calibrated model's error takes to come back within the band after a change of
pace (the new user's CPU burner, a scheduled slowdown), and the later spells reported apart."""

from bench.calibration_recovery import excursions, recovery_s

BAND = 0.2
START = 1_000.0


def timeline(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(seconds after the burner's start, error) → the study's (unix time, error)."""
    return [(START + t, e) for t, e in points]


def steady(until_s: float, error: float = 0.05, step_s: float = 0.5) -> list[tuple[float, float]]:
    n = int(until_s / step_s)
    return [(i * step_s, error) for i in range(n + 1)]


def test_the_error_that_leaves_the_band_at_the_start_is_timed_until_it_settles_back():
    points = [(t, 0.05) for t in (-1.0, -0.5, 0.0, 0.5)]
    points += [(1.0, 0.6), (2.0, 0.4), (3.0, 0.25), (4.0, 0.15)]
    points += [(t, 0.1) for t in (5.0, 6.0, 7.0, 8.0)]
    assert recovery_s(timeline(points), START, BAND) == 4.0


def test_an_error_that_never_leaves_the_band_recovers_at_once():
    assert recovery_s(timeline(steady(30.0)), START, BAND) == 0.0


def test_a_spell_long_after_the_start_is_noise_not_the_change_of_pace():
    """Session 42's run: the error stayed within the band for 20 s under the burner, then left
    it for a moment; the measure once timed the recovery from that moment (20.6 s)."""
    points = steady(30.0)
    points = [(t, 0.21 if 20.0 <= t <= 20.5 else e) for t, e in points]
    series = timeline(points)
    assert recovery_s(series, START, BAND) == 0.0
    assert excursions(series, START, BAND) == [
        {"at_s": 20.0, "duration_s": 1.0, "peak_error": 0.21}
    ]


def test_an_error_that_never_comes_back_has_no_recovery():
    points = [(0.0, 0.05)] + [(t, 0.5) for t in (1.0, 2.0, 5.0, 10.0, 20.0)]
    series = timeline(points)
    assert recovery_s(series, START, BAND) is None
    assert excursions(series, START, BAND) == [{"at_s": 1.0, "duration_s": 19.0, "peak_error": 0.5}]


def test_a_brief_dip_inside_the_spell_is_not_a_recovery():
    """Back within the band for one point, then above 1.5 × the band within the hold: not yet."""
    points = [(0.0, 0.05), (1.0, 0.5), (2.0, 0.18), (3.0, 0.45), (4.0, 0.1)]
    points += [(t, 0.1) for t in (5.0, 6.0, 7.0, 8.0)]
    assert recovery_s(timeline(points), START, BAND) == 4.0


def test_excursions_before_the_start_are_not_listed():
    points = [(-2.0, 0.5), (-1.0, 0.05), *steady(5.0)]
    assert excursions(timeline(points), START, BAND) == []
